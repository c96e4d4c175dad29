"""The worker's Redis plumbing: connection, publisher thread, heartbeat thread (the listener of
the abort and control channels is worker/io/listener.py).

`Publisher` is the only writer of token events: one FIFO thread, so the events of one
request leave in order, and each round is ONE call of the STEP script (worker/io/scripts.py):
it checks that this consumer is not fenced (else it writes nothing), then logs the
round's events and progress in the worker's log hash (one HSET for every request),
ends finished attempts (final, XACK+XDEL), and PUBLISHes every event of the round in one
`TokenEventBatch` on the worker's out channel. A failed round is resent until Redis answers
(every write in it is idempotent; gateways drop duplicates by `seq`). `Heartbeat` runs on its
own thread, so a publisher waiting for Redis never stops it. Key names and delivery
guarantees are in `protos/keys.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from protos.convert import admitted_value, log_value, room_value
from protos.keys import Heartbeat as HeartbeatField
from protos.redis_conn import Backoff, sync_client, text
from protos.tokenrelay.v1 import queue_pb2
from worker.config import WorkerConfig
from worker.io.scripts import HEARTBEAT, STEP

log = logging.getLogger(__name__)

LOG_RENEW_S = 10.0  # how often a heartbeat renews the log's TTL (see Heartbeat)
CLOSE_FLUSH_TIMEOUT_S = 5.0  # how long a stopping worker keeps trying to publish its last events
# An ended attempt's entry stays pending until a gateway has seen this worker hold it (its
# record then names this worker's log: worker/io/scripts.py STEP), so that its final or error
# is not refused and a later resume finds the answer. A gateway following the request does that
# within a round trip of hearing the worker; after this long nobody followed it, and the entry is
# acknowledged anyway (a later resume generates the answer again, with the same seed). A
# stopping worker waits at most CLOSE_END_WAIT_S for it.
UNSEEN_END_WAIT_S = 2.0
CLOSE_END_WAIT_S = 1.0


def connect(config: WorkerConfig) -> redis.Redis:
    """A client that fails fast (no hidden retries): the loops below own the retrying."""
    return sync_client(config.redis_url, config.redis_timeout_s)


@dataclass(frozen=True)
class End:
    """An attempt that ended: its final seq (logged) and its entry to acknowledge."""

    request_id: str  # "" for an unreadable entry (no record)
    # The entry is acknowledged only once this record names this worker's log (a gateway saw it
    # hold the entry: the STEP script); "" acknowledges it all the same.
    record: str
    final_seq: int | None
    stream: str
    entry_id: bytes
    since: float = field(default_factory=time.monotonic)  # when the attempt ended


@dataclass
class Outbox:
    """One round's writes (the STEP script's sections)."""

    logged: dict[str, list[queue_pb2.TokenEvent]] = field(default_factory=dict)  # request id -> events
    published: list[queue_pb2.TokenEvent] = field(default_factory=list)  # errors: not logged
    progress: dict[str, bytes] = field(default_factory=dict)  # request id -> queue.Progress
    # request id -> its prompt's tokens: admitted this round (billing, and the gateways' notice)
    admitted: dict[str, int] = field(default_factory=dict)
    ends: list[End] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # log fields of expired results
    # The worker's free sequence slots after the round (TokenEventBatch.room): published with
    # whatever the round publishes, never a publish of its own.
    room: int | None = None

    def log(self, event: queue_pb2.TokenEvent) -> None:
        """Log the event (a chunk or the final) in the worker's log, then publish it."""
        self.logged.setdefault(event.request_id, []).append(event)

    def publish(self, event: queue_pb2.TokenEvent) -> None:
        self.published.append(event)

    def ack(self, stream: str, entry_id: bytes) -> None:
        """An entry without a record (unreadable): acknowledge it only."""
        self.ends.append(End("", "", None, stream, entry_id))

    def end(self, request_id: str, record: str, stream: str, entry_id: bytes,
            final_seq: int | None = None) -> None:
        """The attempt ended: log its final (if any) and acknowledge its entry."""
        self.ends.append(End(request_id, record, final_seq, stream, entry_id))

    def merge(self, other: Outbox) -> None:
        for request_id, events in other.logged.items():
            self.logged.setdefault(request_id, []).extend(events)
        self.published += other.published
        self.progress.update(other.progress)  # the later progress knows more
        self.admitted.update(other.admitted)
        self.ends += other.ends
        self.drops += other.drops
        if other.room is not None:  # the later round knows better
            self.room = other.room

    def args(self, prefix: str, consumer: str) -> list[bytes | str | int]:
        """ARGV of the STEP script (its comment has the layout)."""
        # one run of consecutive seqs a section item: its first seq names every event's field
        runs = [(request_id, run) for request_id, events in self.logged.items()
                for run in _consecutive(events)]
        args: list[bytes | str | int] = [prefix, consumer, len(runs)]
        for request_id, run in runs:
            args += [request_id, run[0].seq, len(run), *(log_value(e) for e in run)]
        args.append(len(self.progress))
        for request_id, progress in self.progress.items():
            args += [request_id, progress]
        args.append(len(self.admitted))
        for request_id, num_tokens in self.admitted.items():
            args += [request_id, num_tokens, admitted_value(request_id)]
        published = [log_value(e) for e in self.published]
        if self.room is not None and (self.logged or self.published or self.admitted):
            published.append(room_value(self.room))
        args += [len(published), *published]
        args.append(len(self.ends))
        for e in self.ends:
            args += [e.request_id, e.record, "" if e.final_seq is None else e.final_seq, e.stream, e.entry_id]
        args += [len(self.drops), *self.drops]
        return args

    def __bool__(self) -> bool:
        return bool(self.logged or self.published or self.progress or self.admitted or self.ends
                    or self.drops)


def _consecutive(events: list[queue_pb2.TokenEvent]) -> list[list[queue_pb2.TokenEvent]]:
    """The events split where their seq does not go up by one (a round has one run a request)."""
    runs = [[events[0]]]
    for event in events[1:]:
        if event.seq == runs[-1][-1].seq + 1:
            runs[-1].append(event)
        else:
            runs.append([event])
    return runs


class Publisher:
    """Background thread sending outboxes, one STEP script call per round.

    `on_fenced` is called once if this consumer was fenced (it must stop: every request it
    holds belongs to another worker now).
    """

    def __init__(self, client: redis.Redis, config: WorkerConfig, on_error: Callable[[], None] | None = None,
                 on_fenced: Callable[[], None] | None = None) -> None:
        """on_error: called (on this thread) for every failed round."""
        self._client, self._config, self._keys = client, config, config.keys
        self._on_error, self._on_fenced = on_error, on_fenced
        self._queue: queue.Queue[Outbox | None] = queue.Queue()
        self._give_up_at = float("inf")
        self._step = client.register_script(STEP)
        self._left: list[End] = []  # ended attempts no gateway has seen this worker hold yet
        self._left_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, outbox: Outbox) -> None:
        self._queue.put(outbox)

    def close(self) -> None:
        """Send what is queued (trying for at most CLOSE_FLUSH_TIMEOUT_S)."""
        self._give_up_at = time.monotonic() + CLOSE_FLUSH_TIMEOUT_S
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        closing = False
        while not closing:
            outbox, closing = self._collect(self._queue.get())
            if outbox:
                self._send(outbox)
        give_up_at = min(self._give_up_at, time.monotonic() + CLOSE_END_WAIT_S)
        while ends := self.take_left(float("inf") if time.monotonic() > give_up_at else time.monotonic()):
            self._send(Outbox(ends=ends))
            time.sleep(0.05)

    def _collect(self, first: Outbox | None) -> tuple[Outbox, bool]:
        """Merge everything already queued, so a backlog goes out as one round."""
        outbox, closing = Outbox(), first is None
        if first is not None:
            outbox.merge(first)
        while not closing:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                closing = True
            else:
                outbox.merge(item)
        return outbox, closing

    def _send(self, outbox: Outbox) -> None:
        backoff = Backoff(self._config.max_backoff_s)
        while True:
            args = outbox.args(self._keys.prefix, self._config.consumer_name)
            try:
                reply = self._step(args=args)
            except redis.ResponseError as e:  # a bug in the round, not an outage: resending cannot help
                log.error("Redis refused a round of %d requests' events: %s", len(outbox.logged), e)
                return
            except redis.RedisError as e:
                if self._on_error is not None:
                    self._on_error()
                if time.monotonic() > self._give_up_at:
                    log.error("dropping the events of %d requests: Redis unreachable at shutdown (%s)",
                              len(outbox.logged), e)
                    return
                delay = backoff.failed()
                log.warning("publish failed (%s); retrying in %.2fs", e, delay)
                time.sleep(delay)  # nothing else for this thread to do until Redis answers
                continue
            break
        if reply[0] == b"fenced":
            log.error("this worker (%s) was fenced: a sweeper judged it dead and queued its requests "
                      "again; its round of %d requests was refused", self._config.consumer_name,
                      len(outbox.logged))
            if self._on_fenced is not None:
                self._on_fenced()
            return
        if len(reply) > 1:
            left = {(text(s), text(e)) for s, e in zip(reply[1::2], reply[2::2], strict=True)}
            with self._left_lock:
                self._left += [e for e in outbox.ends if (e.stream, text(e.entry_id)) in left]

    def take_left(self, now: float) -> list[End]:
        """The ended attempts whose entries the last rounds left pending (STEP), to end again; those
        that waited UNSEEN_END_WAIT_S by `now` (monotonic) are acknowledged all the same."""
        with self._left_lock:
            left, self._left = self._left, []
        return [dataclasses.replace(e, record="") if now - e.since > UNSEEN_END_WAIT_S else e for e in left]


def heartbeat_fields(config: WorkerConfig, s: Any, num_finished: int, num_parked: int,
                     adapters: Sequence[str]) -> dict[str, str]:
    """Heartbeat fields from the engine's stats (`EngineStats`; strings: they go into a Redis
    hash); `Heartbeat` adds the time. The model is the served name (--served-model-name)."""
    H = HeartbeatField
    fields = {
        H.WORKER_ID: config.worker_id, H.MODEL: config.model_name, H.ADAPTERS: ",".join(sorted(adapters)),
        H.WEIGHTS: s.weights, H.NUM_FINISHED: num_finished,
        H.NUM_RUNNING: s.num_running, H.NUM_WAITING: s.num_waiting, H.MAX_NUM_SEQS: s.max_num_seqs,
        H.MAX_MODEL_LEN: s.max_model_len, H.BLOCK_SIZE: s.block_size, H.NUM_BLOCKS: s.num_blocks,
        H.NUM_FREE_BLOCKS: s.num_free_blocks, H.KV_CACHE_USAGE: s.kv_cache_usage,
        H.NUM_PREFIX_CACHE_HIT_TOKENS: s.num_prefix_cache_hit_tokens,
        H.NUM_PREFIX_CACHE_QUERY_TOKENS: s.num_prefix_cache_query_tokens,
        H.NUM_PREEMPTIONS: s.num_preemptions, H.NUM_PARKED: num_parked,
        H.NUM_SPEC_DRAFT_TOKENS: s.num_spec_draft_tokens,
        H.NUM_SPEC_ACCEPTED_TOKENS: s.num_spec_accepted_tokens,
    }
    return {k: str(v) for k, v in fields.items()}


class Heartbeat:
    """Background thread renewing this consumer's registry entry and heartbeat hash.

    It has its own thread so that nothing else (a publisher waiting for Redis, a long step)
    delays it. `set_load` wakes it when a field in `HeartbeatField.EVENTS` changed.
    """

    def __init__(self, client: redis.Redis, config: WorkerConfig,
                 on_fenced: Callable[[], None] | None = None) -> None:
        self._client, self._config, self._keys = client, config, config.keys
        self._on_fenced = on_fenced
        self._load: dict[str, str] = {}
        self._sent: dict[str, str] = {}
        self._changed = threading.Event()
        self._closed = threading.Event()
        self._script = client.register_script(HEARTBEAT)
        name = config.consumer_name
        self._script_keys = [self._keys.registry, self._keys.fence(name), self._keys.worker(name),
                             self._keys.log(name), self._keys.consumer_models]
        self.log_ttl_ms = 0  # how long the log must outlive this worker: its longest result TTL
        # The log's TTL is renewed every LOG_RENEW_S (and at once when log_ttl_ms grows), not at
        # every beat, with that much slack added, so it never expires sooner than one heartbeat
        # TTL plus log_ttl_ms after this worker's last beat.
        self._log_ttl_set = -1  # log_ttl_ms at the last renewal
        self._log_renew_at = 0.0
        self._clock_offset_s = 0.0  # Redis TIME - time.time(), from the last heartbeat
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()  # registered before the first claim
        self._thread.start()

    def set_load(self, load: dict[str, str]) -> None:
        self._load = load
        if any(load.get(k) != self._sent.get(k) for k in HeartbeatField.EVENTS):
            self._changed.set()

    def redis_now(self) -> float:
        """Redis's unix time, estimated: deadlines are judged on Redis's clock (queue.proto)."""
        return time.time() + self._clock_offset_s

    def beat(self) -> bool:
        """One heartbeat; False if Redis did not answer."""
        load = self._load
        fields: list[str] = []
        for name, value in {**load, HeartbeatField.HEARTBEAT_UNIX: repr(time.time())}.items():
            fields += [name, value]
        ttl_ms = int(self._config.heartbeat_ttl_s * 1000)
        sent_at = time.time()
        log_ttl_ms = self.log_ttl_ms
        renew_log = log_ttl_ms != self._log_ttl_set or time.monotonic() >= self._log_renew_at
        try:
            redis_ms = self._script(keys=self._script_keys, args=[
                self._config.consumer_name, ttl_ms, ttl_ms + log_ttl_ms + int(LOG_RENEW_S * 1000),
                self._keys.model, "1" if renew_log else "0", *fields])
        except redis.RedisError as e:
            log.warning("heartbeat failed: %s", e)
            return False
        if renew_log:
            self._log_ttl_set, self._log_renew_at = log_ttl_ms, time.monotonic() + LOG_RENEW_S
        alive = int(redis_ms) > 0
        if alive:  # Redis read its clock about halfway through the round trip
            self._clock_offset_s = int(redis_ms) / 1000 - (sent_at + time.time()) / 2
        self._sent = load
        if not alive and self._on_fenced is not None:
            self._on_fenced()
        return True

    def close(self) -> None:
        """Stop beating and leave: its heartbeat hash goes and its registry score is 0 (dead), so
        the next sweep (gateway/sweeper.py) queues again whatever is still pending under it
        (handed over at a drain, or claimed by an XREADGROUP whose OWN never reached Redis) and
        then removes it. A worker removes no registry member, its own neither: a worker that
        could would hide a dead one from the sweep."""
        self._closed.set()
        self._changed.set()
        if self._thread.is_alive():  # never started: closed right after a failed start
            self._thread.join()
        name = self._config.consumer_name
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.zadd(self._keys.registry, {name: 0})
            pipe.delete(self._keys.worker(name))
            pipe.execute()
        except redis.RedisError as e:
            log.warning("could not leave the worker registry: %s", e)

    def _run(self) -> None:
        interval = self._config.heartbeat_interval_s
        while not self._closed.is_set():
            self._changed.wait(interval)
            self._changed.clear()
            if not self._closed.is_set():
                self.beat()
                # A burst of load changes (many requests finishing) costs at most 10 beats a second.
                self._closed.wait(min(0.1, interval / 5))
