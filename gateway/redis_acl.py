"""`tokenrelay acl worker`: the Redis ACL rules of a worker user, shared or per worker.

deploy/redis/users.acl gives every worker one user, `worker` (its rules are
`worker_rules(prefix)`; tests/test_redis_acl.py checks the file against them). Redis ACLs
name keys and channels by pattern, not by connection, so with one user every worker may write
every worker's heartbeat, log, prefix index and fence set, and publish on every worker's out
channel. A user per worker (`worker_rules(prefix, worker_id)`) narrows those to its own
consumers' names, ``{worker_id}.??????`` (the incarnation: protos/keys.py INCARNATION_LEN), so
that, with the gateway taking a request's events only from the out channel of the worker that
holds its entry (gateway/sources.py), a worker cannot put tokens into a stream it does not run by
publishing them. No worker user may write a request record (only gateways do: a worker could
otherwise point one at a log it forged), nor XCLAIM, fence or deregister another worker: the
gateways sweep for dead workers (gateway/sweeper.py). deploy/redis/README.md says what is still
open.

    tokenrelay acl worker --worker-id w1 [--user worker-w1] [--key-prefix tokenrelay]

prints the user's line for an ACL file (`ACL SETUSER` takes the same rules); the worker then
runs with --worker-id w1 and that user in its --redis-url.

Many workers without a password each to keep: a StatefulSet's pods have stable names, and each
one's password is derived from one secret, the worker key (HMAC-SHA256 of the worker id, hex),
which only the init containers see (deploy/k8s):

    TOKENRELAY_WORKER_KEY=... tokenrelay acl statefulset-users tokenrelay-worker=20

prints the lines of worker ids tokenrelay-worker-0 .. -19 (each password as its SHA-256), and

    TOKENRELAY_WORKER_KEY=... tokenrelay acl worker-password --worker-id tokenrelay-worker-3

prints that worker's password, for its REDIS_URL.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import sys

from protos.keys import DEFAULT_PREFIX, INCARNATION_LEN, Keys

# Glob characters would widen the patterns; '.' is safe: the incarnation's length is fixed.
_WORKER_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
PASSWORD_PLACEHOLDER = ">CHANGE-ME-{user}-password"
WORKER_KEY_ENV = "TOKENRELAY_WORKER_KEY"  # the secret every derived worker password comes from
COMMANDS = "resetkeys resetchannels -@all +select +time +script|load +script|exists +pubsub|numsub"


def worker_rules(prefix: str = DEFAULT_PREFIX, worker_id: str | None = None) -> str:
    """The selectors of a worker user: every worker's (worker_id None, the shared user) or one
    worker's own keys and channel."""
    Keys(prefix)  # validates the prefix
    if worker_id is not None and not _WORKER_ID.match(worker_id):
        raise ValueError(f"a worker id with its own Redis user must be 1-64 of [A-Za-z0-9._-], "
                         f"got {worker_id!r}")
    p = prefix
    own = "*" if worker_id is None else f"{worker_id}.{'?' * INCARNATION_LEN}"
    return " ".join([
        # The scripts' declared keys (STEP declares none: its keys follow from its arguments).
        f"(~{p}:log:{own} ~{p}:registry ~{p}:fence:{own} ~{p}:worker:{own} ~{p}:consumer-models +evalsha)",
        f"(~{p}:model:* ~{p}:routed:* +xgroup|create +xreadgroup +xpending +xrange +xack +xdel)",
        f"(~{p}:prefixes:{own} +zadd +zremrangebyrank +pexpire)",
        f"(%R~{p}:request:* +hget +hmget)",  # only gateways write records (gateway/sources.py)
        f"(%R~{p}:log:* +hget +hmget)",  # a claim copies the log its record names (OWN)
        f"(~{p}:log:{own} +hget +hmget +hset +hdel +pexpire)",
        # Fence marks: its own (STEP, HEARTBEAT) and a log's worker's (OWN takes only a fenced one's).
        f"(%R~{p}:fence:* +sismember)",
        f"(~{p}:registry +zrangebyscore +zadd)",  # no ZREM: a worker cannot hide a dead one
        f"(~{p}:worker:{own} +hset +pexpire +del)",
        f"(~{p}:consumer-models +hset +hmget)",
        f"(%R~{p}:adapters:* +hgetall)",
        f"(&{p}:out:{own} +publish)",
        f"(&{p}:aborts &{p}:control:* +subscribe)",
    ])


def worker_user_line(user: str, prefix: str = DEFAULT_PREFIX, worker_id: str | None = None,
                     password: str = "") -> str:
    """One ACL-file line: `user NAME on PASSWORD RULES`. password: '>...' or '#<sha256 hex>'
    (default: a placeholder to replace before use, as in users.acl)."""
    secret = password or PASSWORD_PLACEHOLDER.format(user=user)
    return f"user {user} on {secret} {COMMANDS} {worker_rules(prefix, worker_id)}"


def worker_password(key: str, worker_id: str) -> str:
    """The Redis password of `worker_id`, derived from the worker key: HMAC-SHA256, hex (URL-safe).
    Knowing one worker's password tells nothing of another's, nor of the key."""
    if not key:
        raise ValueError(f"the worker key is empty: set {WORKER_KEY_ENV}")
    return hmac.new(key.encode(), worker_id.encode(), hashlib.sha256).hexdigest()


def statefulset_user_lines(statefulsets: list[tuple[str, int]], key: str,
                           prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The user line of every pod a StatefulSet named NAME may run with up to COUNT replicas
    (worker ids NAME-0 .. NAME-(COUNT-1)), each password derived from `key`, stored as its SHA-256."""
    lines = []
    for name, count in statefulsets:
        for ordinal in range(count):
            worker_id = f"{name}-{ordinal}"
            digest = hashlib.sha256(worker_password(key, worker_id).encode()).hexdigest()
            lines.append(worker_user_line(f"worker-{worker_id}", prefix, worker_id, f"#{digest}"))
    return lines


def _statefulset(value: str) -> tuple[str, int]:
    name, _, count = value.partition("=")
    if not _WORKER_ID.match(name) or not count.isdigit() or not 0 < int(count) <= 1000:
        raise argparse.ArgumentTypeError(f"expected NAME=COUNT (a StatefulSet and its most replicas, "
                                         f"1-1000), got {value!r}")
    return name, int(count)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="role", required=True, metavar="ROLE")
    worker = sub.add_parser("worker", help="the ACL-file line of a worker's own Redis user",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--worker-id", required=True, help="the worker's --worker-id: 1-64 of [A-Za-z0-9._-]")
    worker.add_argument("--user", help="the Redis user's name (default worker-<worker id>)")
    worker.add_argument("--key-prefix", default=os.environ.get("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                        help="prefix of every Redis key [env TOKENRELAY_KEY_PREFIX]")
    worker.add_argument("--password-sha256", help="hex SHA-256 of its password (default: a placeholder)")
    derived = f"the worker key in env {WORKER_KEY_ENV}"
    sets = sub.add_parser("statefulset-users", help="the ACL-file lines of every pod of worker "
                          f"StatefulSets, their passwords derived from {derived}")
    sets.add_argument("statefulsets", nargs="+", type=_statefulset, metavar="NAME=COUNT",
                      help="a StatefulSet and the most replicas it may run (its autoscaler's maximum)")
    sets.add_argument("--key-prefix", default=os.environ.get("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                      help="prefix of every Redis key [env TOKENRELAY_KEY_PREFIX]")
    password = sub.add_parser("worker-password", help=f"a worker's Redis password, derived from {derived}")
    password.add_argument("--worker-id", required=True, help="the worker's --worker-id (its pod's name)")


def run(args: argparse.Namespace) -> int:
    if args.role == "worker":
        password = f"#{args.password_sha256}" if args.password_sha256 else ""
        user = args.user or f"worker-{args.worker_id}"
        print(worker_user_line(user, args.key_prefix, args.worker_id, password))
        return 0
    key = os.environ.get(WORKER_KEY_ENV, "")
    if not key:
        print(f"tokenrelay acl: set {WORKER_KEY_ENV} to the worker key", file=sys.stderr)
        return 2
    if args.role == "worker-password":
        print(worker_password(key, args.worker_id))
    else:
        print("\n".join(statefulset_user_lines(args.statefulsets, key, args.key_prefix)))
    return 0
