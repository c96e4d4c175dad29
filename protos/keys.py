"""Every Redis key, stream and channel tokenrelay uses, in one place.

All names start with a prefix (default ``tokenrelay``) so several deployments
or test runs can share one Redis. ``{p}`` below is that prefix.

| name                     | type    | TTL          | written by                | read by                  |
|--------------------------|---------|--------------|---------------------------|--------------------------|
| {p}:model:{m}:requests   | stream  | none         | gateway XADD (``data``)   | model m's workers        |
| {p}:model:{m}:requests:high | stream | none       | gateway XADD (``data``)   | model m's workers        |
| {p}:model:{m}:requests:low  | stream | none       | gateway XADD (``data``)   | model m's workers        |
| {p}:consumer-models      | hash    | none         | workers' HEARTBEAT        | sweeper (models to search)|
| {p}:adapters:{m}         | hash    | none         | operators (`tokenrelay    | model m's workers        |
|                          |         |              | adapter load/unload`)     |                          |
| {p}:control:{m}          | channel | -            | the same command          | model m's workers        |
| {p}:routed:{class}:{c}   | stream  | none         | gateway XADD (routing),   | worker {c} XREADGROUP    |
|                          |         |              | MOVE                      | gateway MOVE, sweeper    |
| {p}:prefixes:{consumer}  | zset    | PREFIX_INDEX | that worker, per claim    | gateways (routing)       |
|                          |         | _TTL_S       |                           |                          |
| {p}:workers              | group   | (on each     | worker XGROUP CREATE/XACK,| gateway XINFO/XPENDING   |
|                          |         |  stream)     | sweeper XACK/DELCONSUMER  |                          |
| {p}:request:{request_id} | hash    | lease (*)    | gateways only: ATTACH,    | gateways, workers (OWN,  |
|                          |         |              | VERIFY, SETTLE, SHORTEN,  | STEP)                    |
|                          |         |              | MOVE, the sweeper         |                          |
| {p}:log:{consumer}       | hash    | longest      | that worker's STEP, OWN   | gateways READ_LOG, OWN   |
|                          |         | result TTL   |                           | of a taker               |
| {p}:out:{consumer}       | channel | -            | that worker's STEP        | every gateway PSUBSCRIBE |
| {p}:events:{request_id}  | channel | -            | (nothing: presence only)  | workers PUBSUB NUMSUB    |
| {p}:registry             | zset    | none         | workers' HEARTBEAT, sweeper| everyone (candidates)   |
| {p}:fenced               | set     | 24 h         | the gateways' sweeper     | operators (who was fenced)|
| {p}:sweep-clock          | hash    | none         | the gateways' sweeper     | the gateways' sweeper    |
| {p}:fence:{consumer}     | set     | 24 h         | the gateways' sweeper     | its STEP, HEARTBEAT; OWN |
| {p}:aborts               | channel | -            | gateway PUBLISH           | every worker (SUBSCRIBE) |
| {p}:gateway:{gateway_id} | channel | -            | (nobody yet)              | that gateway (SUBSCRIBE) |
| {p}:worker:{consumer}    | hash    | worker's TTL | worker HEARTBEAT          | gateway (GetServerInfo), |
|                          |         |              |                           | sweeper (alive = exists) |
| {p}:tenant:{name}:calls  | zset    | slot TTL (+) | gateway scripts           | gateways (admission)     |
| {p}:tenant:{name}:tokens | hash    | until full   | gateway script            | gateways (admission)     |
(*) RECORD_LEASE_S from creation, then the request's result TTL once a gateway relayed its final.
(+) the gateway's --quota-slot-ttl, renewed with every admission and refresh.
No key is ever found by SCAN: the registry answers "which workers are alive" in one round
trip, and every other key is named by a request id or a consumer name.

A worker *process* is one consumer of the group, named ``{worker_id}.{incarnation}``
(worker/config.py): a restart under the same --worker-id is a new consumer, and the old
one is fenced and its requests queued again like any dead worker's.

Models (one set of streams per served model)
  A worker serves one model under its --served-model-name (`check_model_name`; default the
  model file's name) and claims only that model's streams; `Keys.for_model(m)` names them.
  ``{p}:model:{m}:requests`` is model m's NORMAL stream. GenerateRequest.model picks the
  model (the gateway's --default-model when empty), and so the streams; a model that no
  live worker serves (nor served in the gateway's last 60 s) and the gateway's --models does
  not name is refused with NOT_FOUND (UNAVAILABLE while nothing at all is served;
  gateway/models.py), so nothing waits long in a stream no worker reads. The model is part of
  the body digest like the priority: every attempt at a request goes to the same model's
  streams. Each worker's HEARTBEAT writes its model into ``{p}:consumer-models``
  (consumer -> model): a draining worker hands over only when another of its model is alive,
  and the sweeper searches those models' streams for a dead worker's entries (it sends each
  back to its own model's stream, by the entry's request) and HDELs the field with the
  registry entry. GenerateRequest.adapter names a LoRA adapter of the model: every worker
  heart-beats the adapters it has loaded (`Heartbeat.ADAPTERS`). Adapters loaded at run
  time are the hash ``{p}:adapters:{m}`` (name -> path on the workers' disk), which each of
  model m's workers loads at start and re-reads on any message on ``{p}:control:{m}``.

Requests (one stream per priority class, each with the same consumer group)
  GenerateRequest.priority picks the request's class (`PriorityClass.of`): < 0 LOW,
  0 or unset NORMAL, > 0 HIGH. Each class has its own stream per model: NORMAL is
  ``{p}:model:{m}:requests``, HIGH ``...:requests:high``, LOW ``...:requests:low``.
  Everything below (pending entries, the sweep, XACK after the final) holds per stream:
  the group ``{p}:workers`` exists on each. The priority is part of the body digest, so every
  attempt at a request goes to the same stream, and an entry id names an attempt
  together with its request's class. Queue depth is the sum over the classes.
  A gateway XADDs one entry per attempt at a request: ``data`` =
  ``queue.QueuedRequest`` bytes. Workers XREADGROUP ``>`` only as many entries
  as they can run now (room in their batch, and none while their engine has
  requests waiting for KV-cache blocks), so what stays in the stream is real
  queue depth and other workers can take it. The group is created at id 0 with
  MKSTREAM by whoever needs it first (and again after a Redis restart lost it),
  so nothing added before the group existed is skipped. Claiming goes class by class,
  HIGH first (worker/io/claim.py): a lower class is read only with capacity left, so a
  queued high-priority request is claimed before every queued normal or low one (a
  request already running is not displaced: its engine preempts the lowest priority
  first only when KV blocks run out). An idle worker blocks on all the streams at once
  and may wake with one entry of each class.

The request record and its log: one generation per request id
  ``{p}:request:{request_id}`` (fields: `Record` below) names the request's body (a
  digest), its seed, its current attempt (stream entry id) and the log hash holding its
  events. Only gateways write records: a worker user may not (deploy/redis), as a worker that
  could would point a record at a log it forged. The gateway's ATTACH script
  (gateway/queue.py) creates the record and XADDs the first attempt atomically, or finds the
  record: the same body attaches to it, another body is refused (FAILED_PRECONDITION). A new
  attempt is XADDed only when the current entry has left the stream without a final (its
  worker abandoned or failed it), compare-and-set on ``entry``, so two gateways never start
  two. The record lives RECORD_LEASE_S from its creation; once a gateway relayed the final,
  it lives the gateway's --result-ttl (SHORTEN: never lengthened), so a finished answer is
  replayed, not generated again, for that long.

  The events live in the log hash ``{p}:log:{consumer}`` of the worker running the request
  (fields: `LogField`): ``{request_id}:{seq}`` per chunk and the final (the `queue.TokenEvent`
  framed as a one-event `queue.TokenEventBatch`, so a round's published batch is its events'
  logged values concatenated: protos/convert.py `log_value`), ``{request_id}:n`` the next
  seq, ``{request_id}:p`` the `queue.Progress` (seed, first-token time: O(1), written when it
  changes, never the tokens so far), ``{request_id}:f`` the final's seq, ``{request_id}:t``
  the prompt's token count and ``{request_id}:a`` the entry the worker holds. One HSET per
  worker round logs every request's events, so a round costs O(new tokens) whatever the output
  length. A worker writes only its own log (deploy/redis: a per-worker user may be refused
  every other). The record names a worker's log (``log``) once a gateway saw that worker hold
  the request's current entry in the stream's pending list (VERIFY, gateway/sources.py: only a
  claim writes the pending list, and no worker can move an entry in it), or the sweeper found
  it holding the entry when it died: so every log a record names is one a gateway may trust,
  and it holds every event a caller was sent. A claim (OWN script) copies the request's fields
  from the log its record names into the claimant's log. Each worker HDELs its fields once the
  result TTL passed, and the hash itself expires (its TTL, the longest result TTL, is renewed
  with every heartbeat) when its worker is gone. A resume reads the chunks it needs with
  READ_LOG (HMGET of ``{request_id}:{K..}`` in the log the record names): its cost is what it
  returns, never HGETALL.

Request ids are per tenant
  Below, ``{request_id}`` is the request's key: ``{tenant}/{request_id}`` with
  authentication on (`tenant_request_key`), the caller's id alone with it off. A
  tenant name is [A-Za-z0-9._-] and a caller's id [A-Za-z0-9._:-], so the "/" cannot be
  forged from either side: two tenants' ``order-123`` are two records, another tenant's id
  reads exactly like a never-used one (no FAILED_PRECONDITION oracle), and nobody can
  squat another tenant's ids. Callers only ever see their own id (GenerateResponse).

Delivery guarantee: every chunk exactly once to a caller that keeps resending.
  Per round a worker makes ONE call of its STEP script (worker/io/scripts.py): it checks
  the fence (below), logs the round's events and progress of every request in one HSET,
  ends attempts (the final into its log, XACK+XDEL of the entry), and PUBLISHes every event
  of the round in one ``queue.TokenEventBatch`` on ``{p}:out:{consumer}``. A script is
  atomic, so an event is logged before anyone hears of it, and an entry leaves the stream
  only once its final is logged. Every gateway PSUBSCRIBEs ``{p}:out:*`` once and hands
  events to its calls by request id, taking a request's events only from the out channel of
  the worker that VERIFY accepts (the round that admits a request announces it,
  ``TokenEventBatch.admitted``, so the gateway checks during the prefill; gateway/sources.py).
  An ended attempt's entry is acknowledged only once its record names the worker's log (a
  gateway saw it hold the entry), else left pending for the next rounds, for at most
  UNSEEN_END_WAIT_S (worker/io/redis_io.py): an XACK would empty the pending list VERIFY
  judges by, and the final or error published with it would be refused. A call registers locally before
  it reads the log or enqueues anything, so an event is either in the log it reads or arrives after (or both:
  duplicates are dropped by ``seq``). Events carry a per-request ``seq`` 0, 1, 2, ...
  that every attempt continues: a chunk's seq is its index and the final's is the number
  of chunks (errors take none, and are published, not logged), so a caller resuming at
  chunk K needs seq K on. A gap that the log cannot fill fails the call with DATA_LOSS
  (Redis lost acknowledged writes; a retry cannot help), never silently.
  Queue depth = XLEN - group pending (entries claimed, not yet finished), summed over the
  request streams. Redis commands per round do not grow with the batch; per token, a
  round costs one HSET field pair and ~100 bytes of one PUBLISH.

  Nobody listening: each call SUBSCRIBEs ``{p}:events:{request_id}``, which carries
  nothing; its subscriber count says who follows the request. A worker counts them
  (PUBSUB NUMSUB, one command for all its requests) about once a second and at once on
  an Abort hint, and parks what nobody follows: it leaves the batch between two steps,
  its full KV blocks stay in the prefix cache, and the worker keeps its progress (at most
  --max-parked; a park beyond it abandons the attempt at once). The entry stays pending
  under this worker. When a listener appears (a resume on any gateway; the worker polls
  NUMSUB) it is re-admitted with the same tokens and seed, so the continuation is the one
  it would have had. After the worker's --reattach-grace nobody came: the entry is
  acknowledged without a final (abandoned) and the log keeps its progress; a later resume
  starts a new attempt from there.

Routing (protos/routing.py; the gateway's --routing prefix)
  Each worker keeps ``{p}:prefixes:{consumer}``: the prefix hashes (`routing.prefix_hashes`,
  keyed by the cache scope) of the requests it claimed, scored by when (its clock), trimmed
  to the most recent `prefix_index_size` (about what its KV cache holds) and expiring
  PREFIX_INDEX_TTL_S after the last claim; written in the claim's round trip, so it costs
  two commands per claim round. A gateway scores the live workers that have room by the
  leading hashes they hold (one ROUTE script call reads them all) and by their load, and
  XADDs the request to the chosen worker's own stream of its class,
  ``{p}:routed:{class}:{consumer}`` (class = high, normal, low), with the record's key in
  the entry (``rec``); a request with no useful overlap goes to the shared stream as
  before. The record's STREAM says where the attempt is. A worker reads its own stream of
  a class before the shared one (HIGH first, as above). Routing is a preference, never a
  wait: an entry its worker has not claimed within the gateway's --route-max-wait-ms is
  moved to the shared stream by the gateway following the call (MOVE script: atomically,
  only while no worker has it), at once for one routed by load alone when its worker's round
  says it is full (``TokenEventBatch.room`` = 0: its free sequence slots, sent with every
  round that publishes anything; gateways also route by it, fresher than the heartbeats),
  and a dead worker's routed streams are emptied by the
  sweeper that fences it (every entry, claimed or not, queued again in the shared stream),
  then deleted. So queue depth, KEDA's lag and shedding see the work: a routed entry waits
  only on a live worker with room, and at most the wait bound.

Fencing: a zombie's writes fail
  A worker is alive while its heartbeat hash ``{p}:worker:{consumer}`` exists: HEARTBEAT
  renews its TTL and the worker's registry score (its expiry, on Redis's clock) together, and
  the heartbeat has its own thread, so a publisher waiting for Redis never stops it. Only
  that worker writes its hash (deploy/redis: with a user per worker no other may), so no
  worker can get another judged dead. Every gateway sweeps about once a second
  (gateway/sweeper.py; workers do not, as they load model files and compiled code and are
  trusted least): every registry member (a worker is in it from its first heartbeat, before
  its first claim, and scores itself 0 as it leaves; only the sweeper removes members), and
  at every tenth sweep the group's consumers too (XINFO CONSUMERS: a consumer the registry
  lost with the last second of an AOF). Its SWEEP script takes the candidates whose hash has
  expired; one that holds nothing leaves the registry and the group, and one that holds
  entries (pending under it, or in its routed streams) is fenced, atomically: the member
  ``*`` in its ``{p}:fence:{consumer}``, its name in ``{p}:fenced`` for operators, score 0
  in the registry until nothing of it is left. Then REQUEUE moves each of its entries to the
  tail of the shared stream of its model and class, one script for the batch: the record
  follows (compare-and-set on its entry, as MOVE; when the dead worker had taken the entry,
  HELD in its log, the record names its log from then on and ``deliveries`` counts it), the
  old entry is acknowledged and deleted, and a finished (its final in the dead worker's log)
  or stale one only deleted. The first worker with room claims it like any other. A fenced
  consumer's STEP and HEARTBEAT (one SISMEMBER of that set) refuse every write; it drops all
  it holds and exits (status 3), like a Kafka producer fenced by a newer epoch. A claim (OWN
  script) leaves a request whose record names another worker's log alone while that worker
  holds it (HELD, no final) and is not fenced (an entry delivered twice after an AOF loss,
  say: 'busy'), and reconciliation looks at the entry again later. Since STEP, SWEEP, REQUEUE and OWN are
  scripts, a round is either wholly before the fence (and the taker resumes after everything
  it published) or refused: a caller never receives a stream spliced from two generations,
  and a zombie's XACK cannot remove the taker's entry. ``deliveries`` in the record counts
  takeovers from owners that died holding the request, across every attempt (a resend does
  not reset it): a request that keeps killing its workers fails with UNAVAILABLE after
  --max-deliveries in all. Every heartbeat stops with Redis (a restart may lose the last second
  of them), and a sweep sent before a stall runs when Redis is back: so after a failed sweep,
  and after a gap in the sweeps on Redis's clock (``{p}:sweep-clock``, kept by the SWEEP
  script), a gateway judges nobody for a worker heartbeat TTL (its --worker-heartbeat-ttl).

  A failed-over request is resumed from the log: the prompt plus the streamed tokens are
  prefilled, sampling continues with the same seed at the next step, and events continue
  at the next seq. A worker that drains on SIGTERM leaves and hands over what it could not
  finish in time the same way; with no other live worker it fails them with UNAVAILABLE
  instead. While an entry waits for the sweep the gateway keeps the call open (bounded by
  the call's deadline).

Reconciliation
  Every --reconcile-interval (5 s) a worker compares XPENDING of its own consumer with what
  it runs or parks. An entry pending under it that it forgot (an XACK or XDEL lost with
  the last second of an AOF) is claimed again: OWN finds its final logged and it is only
  acknowledged, or it is resumed from its log; so no call waits forever and nothing runs
  twice. An entry whose request another live worker holds is left pending and looked at again
  at a later reconciliation (above).

Deadlines are judged on one clock
  ``QueuedRequest.timeout_s`` counts from the time in the attempt's entry id (Redis's clock
  at XADD), and the worker compares it with Redis TIME as its heartbeat reads it, so
  neither the gateway's nor the worker's clock skew expires a request early or late.

  Redis restarts: with AOF (appendfsync everysec, as every Redis tokenrelay starts or
  deploys, with maxmemory and noeviction) the streams, group, records, logs and registry
  survive; a worker resends a failed round until Redis answers, and a gateway
  resubscribes and re-reads its calls' logs, so a call resumes where it was. What the last
  second before a crash wrote may be lost: an entry that vanished is enqueued again by
  the gateway following it (same seed: the same tokens), a forgotten pending entry is
  reconciled, and a chunk that vanished from a log is a gap the gateway reports
  (DATA_LOSS) to a resuming caller. A Redis that comes back empty under a running call:
  the record and the entry are gone, so the gateway following the call attaches again (a
  new record and attempt: the same seed, the same tokens), and the old worker's events are
  refused (it holds no entry of the request any more: it finishes it for nobody); a claim
  over a log with holes starts the request over with the same seed, and a gateway that sees
  a gap it cannot fill starts the next attempt at once when the entry is gone too, and fails
  the call with DATA_LOSS only if that attempt does not fill the gap within
  REGENERATE_GRACE_S (gateway/relay.py). An eviction policy other than noeviction would
  silently drop heartbeats, registry entries, records and logs: never use one.

Aborts
  A call that ends without its final (cancelled, disconnected, deadline)
  publishes ``queue.Abort`` on ``{p}:aborts`` naming its request and entry id:
  a hint, so the worker holding it parks it between two steps instead of one
  step later, after it checked that no other call follows the request.

Tenant quotas (gateway/quotas.py; only with --auth-tokens-file)
  ``{p}:tenant:{name}:calls``: one member per open call of the tenant (``{gateway_id}:{uuid}``),
  scored by the Redis-clock unix ms at which its slot expires. A gateway refreshes the
  scores of its open calls every third of the slot TTL and ZREMs a call's member when it
  ends; a gateway that dies leaves members that stop being refreshed, and the next
  admission drops every member past its score, so a crashed gateway's slots come back
  after one slot TTL. ``{p}:tenant:{name}:tokens`` (fields: `Bucket`): the tenant's
  tokens_per_minute token bucket, refilled continuously at tokens_per_minute / 60 s up to
  tokens_per_minute; it expires when it would be full again (a second after, so 60 s at
  most unless it is in debt). One script checks both and takes a slot and the tokens
  together, or neither; another (SETTLE) ends a call: it frees the slot and gives back what
  the call reserved but did not use, or takes what it used beyond (a long prompt): the
  bucket may go below zero. A call's use includes the prompt of the request it attached to,
  once per generation: the worker writes the prompt's token count into its log when it
  admits the request (``LogField.PROMPT``, STEP's ADMIT section), and SETTLE charges the
  count in the log the record names (one a gateway checked) to the first call that ends after
  that (``Record.PROMPT_BILLED``, HSETNX), whether that call saw the final or left early.

Worker heartbeat
  Each worker's HEARTBEAT script, about every half second and whenever its load changes
  (at most 10 times a second), renews its registry score and its hash (fields: `Heartbeat`
  below) in one HSET, so the fields a gateway reads always come from one moment; the
  hash expires when the worker stops heart-beating. Its model (``{p}:consumer-models``) is
  written when the registry did not have it (first beat, or a Redis that lost it), and its
  log's TTL every 10 s (worker/io/redis_io.py LOG_RENEW_S, with that much slack): a steady beat
  is six commands.
"""

from __future__ import annotations

import enum
import os
import socket
import uuid
from dataclasses import dataclass

DEFAULT_PREFIX = "tokenrelay"
STREAM_DATA_FIELD = b"data"  # the field of a request stream entry holding QueuedRequest bytes
ROUTE_FIELD = b"rec"  # a routed stream entry's second field: its record's key (for MOVE)
# A record is created with this TTL (longer than any realistic wait in the queue plus a
# generation); the worker shortens it to the result TTL once an attempt ends.
RECORD_LEASE_S = 24 * 3600
WORKER_KEY_MARK = ":worker:"
# A worker's prefix index outlives its last claim this long (its cache outlives it too);
# a dead worker's index is never read (only live workers are scored), just left to expire.
PREFIX_INDEX_TTL_S = 3600
FENCE_MARK = "*"  # the member of {p}:fence:{consumer} that fences the whole consumer
# A consumer name is {worker_id}.{incarnation}, the incarnation this many hex digits: a
# per-worker Redis user's patterns name its keys as {worker_id}.?????? (gateway/redis_acl.py).
INCARNATION_LEN = 6


def check_name(what: str, name: str) -> None:
    """ValueError unless `name` can be part of a key: non-empty, without spaces."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{what} must be non-empty without spaces, got {name!r}")


MAX_MODEL_NAME_LEN = 128
_MODEL_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/-")


def check_model_name(what: str, name: str) -> None:
    """ValueError unless `name` can name a served model or adapter: 1-128 of [A-Za-z0-9._/-]
    (Hugging Face ids like org/model fit; no ':' or '*', so key names and ACL patterns stay
    unambiguous)."""
    if not 0 < len(name) <= MAX_MODEL_NAME_LEN or not set(name) <= _MODEL_NAME_CHARS:
        raise ValueError(f"{what} must be 1-{MAX_MODEL_NAME_LEN} characters of [A-Za-z0-9._/-], got {name!r}")


def tenant_request_key(tenant: str, request_id: str) -> str:
    """The request's key (see "Request ids are per tenant"): what records, logs, events and
    channels are named by. tenant "" (authentication off): the caller's id itself."""
    return f"{tenant}/{request_id}" if tenant else request_id


def default_instance_id() -> str:
    """host-pid-random: unique per process (a gateway's reply channel, a worker's consumer
    name and heartbeat key) and readable in GetServerInfo."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class PriorityClass(enum.IntEnum):
    """The request classes, one request stream each (see above); larger = claimed earlier."""

    LOW = -1
    NORMAL = 0
    HIGH = 1

    @classmethod
    def of(cls, priority: int) -> PriorityClass:
        """GenerateRequest.priority (unset = 0) -> its class."""
        return cls.HIGH if priority > 0 else cls.LOW if priority < 0 else cls.NORMAL


CLAIM_ORDER = (PriorityClass.HIGH, PriorityClass.NORMAL, PriorityClass.LOW)


class Heartbeat:
    """Field names of a worker's heartbeat hash ``{p}:worker:{worker_id}``.

    Each field is the `WorkerInfo` field of the same name in generate.proto,
    which documents it. Values are strings (it is a Redis hash); TEXT, INT and
    FLOAT say how the gateway parses them back.
    """

    WORKER_ID = "worker_id"
    MODEL = "model"
    ADAPTERS = "adapters"  # the loaded LoRA adapters' names, comma-separated (WorkerInfo.adapters)
    WEIGHTS = "weights"
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
    NUM_SPEC_DRAFT_TOKENS = "num_spec_draft_tokens"
    NUM_SPEC_ACCEPTED_TOKENS = "num_spec_accepted_tokens"
    NUM_PARKED = "num_parked"  # the consumer's, not the engine's

    # A change of these is published with the next round; the others (block counts,
    # usage, prefix tokens: they change almost every step) ride along, and are at most
    # one heartbeat interval old, so a busy worker writes its hash ~2x a second, not per step.
    EVENTS = (NUM_RUNNING, NUM_WAITING, NUM_FINISHED, NUM_PREEMPTIONS, NUM_PARKED)
    TEXT = (WORKER_ID, MODEL, WEIGHTS)
    LIST = (ADAPTERS,)  # comma-separated
    FLOAT = (HEARTBEAT_UNIX, KV_CACHE_USAGE)
    INT = (NUM_FINISHED, NUM_RUNNING, NUM_WAITING, MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS,
           NUM_FREE_BLOCKS, NUM_PREFIX_CACHE_HIT_TOKENS, NUM_PREFIX_CACHE_QUERY_TOKENS, NUM_PREEMPTIONS,
           NUM_SPEC_DRAFT_TOKENS, NUM_SPEC_ACCEPTED_TOKENS, NUM_PARKED)


class Record:
    """Field names of a request record ``{p}:request:{request_id}`` (see above). Only gateways
    write a record: what a worker says about a request (its progress, final, prompt count) is in
    its own log (`LogField`), and a record names that log only once a gateway saw the worker
    hold the request's current entry in the stream's pending list (gateway/sources.py)."""

    DIGEST = "digest"  # sha256 hex of the caller's GenerateRequest (request_id, resume_from_index cleared)
    SEED = "seed"  # the sampling seed every attempt uses (decimal)
    ENTRY = "entry"  # stream entry id of the current attempt, in the stream STREAM names
    STREAM = "stream"  # the request stream of its priority class (set with every ENTRY)
    # The worker log hash holding the request's events (`LogField`): the log of a worker that
    # held the current entry (the gateways' VERIFY, or the sweeper for a dead worker's entry).
    LOG = "log"
    DELIVERIES = "deliveries"  # takeovers from an owner that died holding it, over all attempts
    # "1" once a call of the tenant was charged for the prompt (`LogField.PROMPT`, gateway/quotas.py
    # SETTLE): every generation's prompt is billed once, to the first call that ends after it.
    PROMPT_BILLED = "prompt_billed"


class LogField:
    """Field names of a request's entries in a worker log hash ``{p}:log:{consumer}``.

    A request key is [A-Za-z0-9._:/-]; a suffix never contains ':' after its first character, so
    the fields of two request keys can never coincide."""

    PROGRESS = ":p"  # {request_id}:p -> queue.Progress (O(1): no token ids)
    NEXT = ":n"  # {request_id}:n -> decimal: seq of the next event (= events logged)
    # {request_id}:a -> the entry id of the attempt this worker holds (OWN), kept with a final and
    # deleted when the attempt ends without one: another worker's OWN leaves a held request alone.
    HELD = ":a"
    FINAL = ":f"  # {request_id}:f -> decimal: seq of the final event (the request has finished)
    PROMPT = ":t"  # {request_id}:t -> decimal: the prompt's tokens as this worker counted them

    @staticmethod
    def event(request_id: str, seq: int) -> str:
        """{request_id}:{seq} -> queue.TokenEvent (chunks and the final; errors are not logged)."""
        return f"{request_id}:{seq}"

    @staticmethod
    def all_of(request_id: str, num_events: int) -> list[str]:
        """Every field the request has in a log."""
        return ([LogField.event(request_id, s) for s in range(num_events)]
                + [request_id + f for f in (LogField.PROGRESS, LogField.NEXT, LogField.HELD, LogField.FINAL,
                                            LogField.PROMPT)])


class Bucket:
    """Field names of a tenant's token bucket ``{p}:tenant:{name}:tokens``."""

    TOKENS = "tokens"  # tokens left at UPDATED_MS (a decimal, may be fractional)
    UPDATED_MS = "updated_ms"  # Redis TIME in unix ms of the last change


@dataclass(frozen=True)
class Keys:
    """Names of every Redis key/stream/channel for one prefix; the request streams are those of
    `model` (a worker's Keys, or `for_model` of a gateway's)."""

    prefix: str = DEFAULT_PREFIX
    model: str = ""  # "" only where no request stream is named (a gateway's base Keys)

    def __post_init__(self) -> None:
        check_name("key prefix", self.prefix)
        if self.model:
            check_model_name("model", self.model)

    def for_model(self, model: str) -> Keys:
        """The same prefix, the streams of `model`."""
        return self if model == self.model else Keys(self.prefix, model)

    @property
    def requests(self) -> str:
        """Stream of queued requests of the NORMAL class."""
        if not self.model:
            raise ValueError("request streams belong to a model: use Keys.for_model")
        return f"{self.prefix}:model:{self.model}:requests"

    @property
    def model_mark(self) -> str:
        """What every model stream's name starts with (ACL patterns, dashboards)."""
        return f"{self.prefix}:model:"

    @property
    def consumer_models(self) -> str:
        """Hash: consumer -> the model it serves (each worker's HEARTBEAT)."""
        return f"{self.prefix}:consumer-models"

    def adapters(self, model: str) -> str:
        """Hash: adapter name -> path, the adapters `model`'s workers load at run time."""
        return f"{self.prefix}:adapters:{model}"

    def control(self, model: str) -> str:
        """Channel: a message tells `model`'s workers to re-read its adapters hash."""
        return f"{self.prefix}:control:{model}"

    def requests_of(self, priority_class: PriorityClass) -> str:
        """Stream of queued requests of one priority class."""
        if priority_class is PriorityClass.NORMAL:
            return self.requests
        return f"{self.requests}:{priority_class.name.lower()}"

    @property
    def request_streams(self) -> tuple[str, ...]:
        """Every request stream, highest class first (CLAIM_ORDER)."""
        return tuple(self.requests_of(c) for c in CLAIM_ORDER)

    def routed(self, consumer: str, priority_class: PriorityClass) -> str:
        """A worker's own stream of one class: what gateways routed to it (see "Routing")."""
        return f"{self.routed_mark}{priority_class.name.lower()}:{consumer}"

    @property
    def routed_mark(self) -> str:
        """What every routed stream's name starts with."""
        return f"{self.prefix}:routed:"

    def routed_streams(self, consumer: str) -> tuple[str, ...]:
        """A worker's own streams, highest class first (CLAIM_ORDER)."""
        return tuple(self.routed(consumer, c) for c in CLAIM_ORDER)

    def claim_streams(self, consumer: str) -> tuple[str, ...]:
        """What a worker reads, in order: per class, its own stream, then the shared one."""
        return tuple(s for c in CLAIM_ORDER for s in (self.routed(consumer, c), self.requests_of(c)))

    def prefixes(self, consumer: str) -> str:
        """Sorted set: the prefix hashes of the requests `consumer` claimed, by when."""
        return f"{self.prefix}:prefixes:{consumer}"

    @property
    def group(self) -> str:
        """Consumer group of the workers on the request stream."""
        return f"{self.prefix}:workers"

    @property
    def aborts(self) -> str:
        """Channel every worker subscribes to for cancellations."""
        return f"{self.prefix}:aborts"

    def record(self, request_id: str) -> str:
        """Hash: one request's body digest, seed, attempt, progress and event log."""
        return f"{self.prefix}:request:{request_id}"

    def events(self, request_id: str) -> str:
        """Channel of one request's token events."""
        return f"{self.prefix}:events:{request_id}"

    def gateway(self, gateway_id: str) -> str:
        """A gateway's own channel: its pub/sub connection stays subscribed with no call open,
        so a dropped connection is noticed at once."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker."""
        return f"{self.prefix}{WORKER_KEY_MARK}{worker_id}"

    @property
    def registry(self) -> str:
        """Sorted set of live consumers (worker processes), scored by heartbeat expiry (Redis ms)."""
        return f"{self.prefix}:registry"

    @property
    def sweep_clock(self) -> str:
        """Hash: Redis ms of the last sweep by any gateway (``last``) and of the end of the last
        gap in sweeps (``since``): after a gap, heartbeats may not have been renewed yet."""
        return f"{self.prefix}:sweep-clock"

    @property
    def fenced(self) -> str:
        """Set of consumers judged dead and fenced (for operators): their writes are refused."""
        return f"{self.prefix}:fenced"

    def fence(self, consumer: str) -> str:
        """Set whose member FENCE_MARK fences `consumer` (the gateways' sweeper adds it)."""
        return f"{self.prefix}:fence:{consumer}"

    def log(self, consumer: str) -> str:
        """Hash (`LogField`): the events and progress of the requests `consumer` runs or ran."""
        return f"{self.prefix}:log:{consumer}"

    def out(self, consumer: str) -> str:
        """Channel: one `TokenEventBatch` per round of `consumer`, every request's events in it."""
        return f"{self.prefix}:out:{consumer}"

    @property
    def out_pattern(self) -> str:
        """PSUBSCRIBE pattern of every worker's out channel (each gateway follows them all)."""
        return f"{self.prefix}:out:*"

    def tenant_calls(self, tenant: str) -> str:
        """Sorted set: the tenant's open calls (max_concurrent slots), scored by expiry in unix ms."""
        return f"{self.prefix}:tenant:{tenant}:calls"

    def tenant_tokens(self, tenant: str) -> str:
        """Hash (`Bucket`): the tenant's tokens_per_minute bucket."""
        return f"{self.prefix}:tenant:{tenant}:tokens"
