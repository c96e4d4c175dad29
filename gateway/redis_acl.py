"""`tokenrelay acl worker`: the Redis ACL rules of a worker user, shared or per worker.

deploy/redis/users.acl gives every worker one user, `worker` (its rules are
`worker_rules(prefix)`; tests/test_redis_acl.py checks the file against them). Redis ACLs
name keys and channels by pattern, not by connection, so with one user every worker may write
every worker's heartbeat, log, prefix index and revoked set, and publish on every worker's out
channel. A user per worker (`worker_rules(prefix, worker_id)`) narrows those to its own
consumers' names, ``{worker_id}.??????`` (the incarnation: protos/keys.py INCARNATION_LEN), so
that, with the gateway taking a request's events only from the out channel of the worker its
record names (gateway/sources.py), a worker cannot put tokens into a stream it does not run by
publishing them. No worker user may XCLAIM, fence or deregister another worker: the gateways
sweep for dead workers (gateway/sweeper.py). deploy/redis/README.md says what is still open.

    tokenrelay acl worker --worker-id w1 [--user worker-w1] [--key-prefix tokenrelay]

prints the user's line for an ACL file (`ACL SETUSER` takes the same rules); the worker then
runs with --worker-id w1 and that user in its --redis-url.
"""

from __future__ import annotations

import argparse
import os
import re

from protos.keys import DEFAULT_PREFIX, INCARNATION_LEN, Keys

# Glob characters would widen the patterns; '.' is safe: the incarnation's length is fixed.
_WORKER_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
PASSWORD_PLACEHOLDER = ">CHANGE-ME-{user}-password"
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
        f"(~{p}:log:{own} ~{p}:registry ~{p}:revoked:{own} ~{p}:worker:{own} ~{p}:consumer-models +evalsha)",
        f"(~{p}:model:* ~{p}:routed:* +xgroup|create +xreadgroup +xpending +xrange +xack +xdel)",
        f"(~{p}:prefixes:{own} +zadd +zremrangebyrank +pexpire)",
        f"(~{p}:request:* +hget +hmget +hset +hsetnx +hincrby +pexpire)",
        f"(%R~{p}:log:* +hget +hmget)",  # a claim copies the last owner's log (OWN)
        f"(~{p}:log:{own} +hget +hmget +hset +hdel +pexpire)",
        # Fence marks: its own (STEP, HEARTBEAT) and a record owner's (OWN takes only a fenced one's).
        f"(%R~{p}:revoked:* +sismember)",
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="role", required=True, metavar="ROLE")
    worker = sub.add_parser("worker", help="the ACL-file line of a worker's own Redis user",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    worker.add_argument("--worker-id", required=True, help="the worker's --worker-id: 1-64 of [A-Za-z0-9._-]")
    worker.add_argument("--user", help="the Redis user's name (default worker-<worker id>)")
    worker.add_argument("--key-prefix", default=os.environ.get("TOKENRELAY_KEY_PREFIX", DEFAULT_PREFIX),
                        help="prefix of every Redis key [env TOKENRELAY_KEY_PREFIX]")
    worker.add_argument("--password-sha256", help="hex SHA-256 of its password (default: a placeholder)")


def run(args: argparse.Namespace) -> int:
    password = f"#{args.password_sha256}" if args.password_sha256 else ""
    user = args.user or f"worker-{args.worker_id}"
    print(worker_user_line(user, args.key_prefix, args.worker_id, password))
    return 0
