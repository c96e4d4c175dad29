"""Every Redis key, stream and channel tokenrelay uses, in one place.

All names start with a prefix (default ``tokenrelay``) so several deployments
or test runs can share one Redis. ``{p}`` below is that prefix.

| name                     | type    | TTL          | written by                | read by                  |
|--------------------------|---------|--------------|---------------------------|--------------------------|
| {p}:requests             | stream  | none         | gateway XADD (``data``)   | workers XREADGROUP       |
| {p}:workers              | group   | (on stream)  | worker XGROUP CREATE/XACK | gateway XINFO/XPENDING   |
| {p}:replies:{gateway_id} | channel | -            | worker PUBLISH            | that gateway (SUBSCRIBE) |
| {p}:aborts               | channel | -            | gateway PUBLISH           | every worker (SUBSCRIBE) |
| {p}:aborted:{request_id} | string  | ABORTED_TTL  | gateway SET EX (entry id) | worker MGET on claim     |
| {p}:worker:{worker_id}   | hash    | worker's TTL | worker HSET+PEXPIRE       | gateway (GetServerInfo)  |
| {p}:progress             | hash    | none (*)     | worker HSET, HDEL on XACK | worker resuming an entry |
(*) fields are deleted with their entry's XACK; the hash itself has no TTL.

Requests (stream + consumer group)
  The gateway XADDs one entry per request: ``data`` = ``queue.QueuedRequest``
  bytes. Workers XREADGROUP ``>`` only as many entries as they can run now
  (room in their batch, and none while their engine has requests waiting for
  KV-cache blocks), so what stays in the stream is real queue depth and other
  workers can take it. The group is created at id 0 with MKSTREAM by whoever
  needs it first (and again after a Redis restart lost it), so nothing added
  before the group existed is skipped.

Delivery guarantee: at least once per request, acknowledged late; streams resume.
  An entry is XACKed and XDELed in the same pipeline that publishes the
  request's final (or error) event, so it leaves the stream only once the
  answer is out. Queue depth = XLEN - group pending (entries claimed, not yet
  finished). After every step a worker also writes each running request's
  ``queue.Progress`` (tokens streamed so far, seed, next seq) into
  ``{p}:progress`` under its entry id, after that step's events in the same
  pipeline; the field is deleted with the XACK.

  If a worker crashes, its claimed entries stay in the group's pending list
  (PEL) under its consumer name. Every worker sweeps the group about once a
  second (XINFO CONSUMERS): a consumer whose heartbeat key expired is dead,
  and its entries that have been idle longer than the heartbeat TTL are
  XCLAIMed (the idle-time guard makes two sweepers racing for one entry
  safe) and resumed from their progress: the prompt plus the streamed tokens
  are prefilled, sampling continues with the same seed at the next step, and
  events continue at the next seq, so the caller's stream has no gap and no
  duplicate (a resent event is dropped by seq). An entry delivered
  ``max_deliveries`` times (it keeps killing workers) is failed with
  UNAVAILABLE instead. Dead consumers with nothing pending are deleted from
  the group. A worker that drains on SIGTERM hands over what it could not
  finish in time the same way: it leaves those entries pending (with their
  progress), deletes its heartbeat and exits; with no other live worker it
  fails them with UNAVAILABLE instead. While an entry waits to be re-claimed
  the gateway keeps the call open (as for a queued request, bounded by the
  call's deadline).

Token events (pub/sub, fire and forget)
  After every engine step a worker publishes, per reply channel, one
  ``queue.TokenEventBatch`` holding that step's events, all channels in one
  pipelined round trip. Each event carries its attempt's stream entry id and a
  per-attempt ``seq`` 0, 1, 2, ...; the gateway drops duplicates (a resent
  pipeline) and fails the call on a gap. A request id may be reused (a client
  retrying after a cancel) while the earlier attempt is still being aborted:
  a call only accepts events of its own entry id and reports the others as
  orphans (aborted by entry id), and a worker runs each attempt under its entry
  id, so two attempts never mix.
  Pub/sub does not buffer: the gateway subscribes once at start-up, before it
  enqueues anything, and fails its in-flight calls if that subscription drops.

Aborts
  A cancelled call publishes ``queue.Abort`` on ``{p}:aborts`` naming its
  request and entry id (every worker listens; the one running that attempt
  aborts it between two steps) and sets
  ``{p}:aborted:{request_id}`` to the request's stream entry id, so a request
  still waiting in the stream is dropped when a worker claims it. Matching the
  entry id, not only the request id, keeps a retry that reuses the request id
  from being dropped too.

Worker heartbeat
  Each worker refreshes its hash (fields: `Heartbeat` below) about every half
  second and whenever its load changes, in one HSET, so the fields a gateway
  reads always come from one moment; the key expires when the worker stops
  heart-beating, so a dead worker disappears.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

DEFAULT_PREFIX = "tokenrelay"
STREAM_DATA_FIELD = b"data"  # the field of a request stream entry holding QueuedRequest bytes
ABORTED_TTL_S = 600  # long enough to outlive any realistic wait in the queue
WORKER_KEY_MARK = ":worker:"


def check_name(what: str, name: str) -> None:
    """ValueError unless `name` can be part of a key: non-empty, without spaces."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{what} must be non-empty without spaces, got {name!r}")


def default_instance_id() -> str:
    """host-pid-random: unique per process (a gateway's reply channel, a worker's consumer
    name and heartbeat key) and readable in GetServerInfo."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Heartbeat:
    """Field names of a worker's heartbeat hash ``{p}:worker:{worker_id}``.

    Each field is the `WorkerInfo` field of the same name in generate.proto,
    which documents it. Values are strings (it is a Redis hash); TEXT, INT and
    FLOAT say how the gateway parses them back.
    """

    WORKER_ID = "worker_id"
    MODEL = "model"
    HEARTBEAT_UNIX = "heartbeat_unix"  # time.time() of the write
    NUM_FINISHED = "num_finished"
    # From the engine's stats, each under its own name.
    NUM_RUNNING = "num_running"
    NUM_WAITING = "num_waiting"
    MAX_NUM_SEQS = "max_num_seqs"
    MAX_MODEL_LEN = "max_model_len"
    BLOCK_SIZE = "block_size"
    NUM_BLOCKS = "num_blocks"
    NUM_FREE_BLOCKS = "num_free_blocks"
    KV_CACHE_USAGE = "kv_cache_usage"
    NUM_PREFIX_CACHE_HIT_TOKENS = "num_prefix_cache_hit_tokens"
    NUM_PREFIX_CACHE_QUERY_TOKENS = "num_prefix_cache_query_tokens"
    NUM_PREEMPTIONS = "num_preemptions"

    # A change of these is published with the next round; the others (block counts,
    # usage, prefix tokens: they change almost every step) ride along, and are at most
    # one heartbeat interval old, so a busy worker writes its hash ~2x a second, not per step.
    EVENTS = (NUM_RUNNING, NUM_WAITING, NUM_FINISHED, NUM_PREEMPTIONS)
    TEXT = (WORKER_ID, MODEL)
    FLOAT = (HEARTBEAT_UNIX, KV_CACHE_USAGE)
    INT = (NUM_FINISHED, NUM_RUNNING, NUM_WAITING, MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS,
           NUM_FREE_BLOCKS, NUM_PREFIX_CACHE_HIT_TOKENS, NUM_PREFIX_CACHE_QUERY_TOKENS, NUM_PREEMPTIONS)


@dataclass(frozen=True)
class Keys:
    """Names of every Redis key/stream/channel for one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_name("key prefix", self.prefix)

    @property
    def requests(self) -> str:
        """Stream of queued requests."""
        return f"{self.prefix}:requests"

    @property
    def group(self) -> str:
        """Consumer group of the workers on the request stream."""
        return f"{self.prefix}:workers"

    @property
    def aborts(self) -> str:
        """Channel every worker subscribes to for cancellations."""
        return f"{self.prefix}:aborts"

    def replies(self, gateway_id: str) -> str:
        """Channel a gateway subscribes to for its requests' token events."""
        return f"{self.prefix}:replies:{gateway_id}"

    def aborted(self, request_id: str) -> str:
        """Marker of a request cancelled before (or while) it was claimed."""
        return f"{self.prefix}:aborted:{request_id}"

    @property
    def progress(self) -> str:
        """Hash: stream entry id -> queue.Progress of a request being generated."""
        return f"{self.prefix}:progress"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker."""
        return f"{self.prefix}{WORKER_KEY_MARK}{worker_id}"

    @property
    def worker_pattern(self) -> str:
        """SCAN MATCH pattern of all worker heartbeat hashes."""
        return f"{self.prefix}{WORKER_KEY_MARK}*"
