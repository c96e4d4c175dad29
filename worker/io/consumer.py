"""The worker's Redis side: claim requests, feed the engine, publish its tokens.

One loop on one thread owns the engine (torch lives behind the
`TextEngineProtocol`; this module imports none) and the requests it holds
(worker/io/held.py: admission, chunks, finals, the round's writes):

    park what nobody follows, re-admit parked requests followed again ->
    claim what the engine can run now (worker/io/claim.py: forgotten
    entries first, then XREADGROUP) -> engine.step() -> hand that step's events and
    progress to the publisher thread

The publisher thread sends each step's writes as ONE call of the STEP script
(worker/io/redis_io.py, worker/io/scripts.py) while the next step computes. It is
a single FIFO thread, so events of one request leave in order. Every write is
fenced: a worker that was fenced (a gateway's sweeper judged it dead and queued its
requests again) writes nothing more and stops. Delivery guarantees and key
names are in `protos/keys.py`.

Redis failures never crash the loop: claiming backs off while the engine keeps
generating, and the publisher resends a failed pipeline until Redis is back
(the gateway drops events it already has by `seq`), so no token generated while
Redis was reachable is lost.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from protos.metrics import MetricsServer
from protos.redis_conn import Backoff
from protos.tokenrelay.v1 import queue_pb2
from protos.tracing import WORKER_SERVICE, Tracing
from worker.config import WorkerConfig
from worker.io.adapters import AdapterSync
from worker.io.claim import Claimer, Owned, claim_capacity
from worker.io.held import HeldRequests, TextEngineProtocol
from worker.io.listener import AbortListener
from worker.io.metrics import WorkerMetrics
from worker.io.parking import POLL_INTERVAL_S, FollowCheck
from worker.io.pending import Claimed, other_workers_alive
from worker.io.redis_io import Heartbeat as HeartbeatThread
from worker.io.redis_io import Publisher, connect, heartbeat_fields
from worker.io.tracing import RequestSpans
from worker.io.tracked import Tracked

log = logging.getLogger(__name__)

ErrorCode = queue_pb2.ErrorCode


class Consumer:
    """Runs one engine against the request stream until `stop()`, then drains."""

    def __init__(self, engine: TextEngineProtocol, config: WorkerConfig,
                 client: redis.Redis | None = None) -> None:
        self.engine, self.config, self.keys = engine, config, config.keys
        self._client = client or connect(config)
        self._metrics_server = MetricsServer(config.metrics_port, compat_vllm=config.metrics_compat == "vllm")
        self._metrics: WorkerMetrics | None = None
        if self._metrics_server.is_enabled:
            lora = config.engine.max_adapters if config.engine.is_lora_enabled else 0
            self._metrics = WorkerMetrics(self._metrics_server.registry, config.model_name,
                                          config.worker_id, lora)
        self.tracing = Tracing(config.otlp_traces_endpoint, WORKER_SERVICE, config.worker_id)
        self._spans = RequestSpans(self.tracing, config.worker_id)
        self._fenced = threading.Event()
        self._publisher = Publisher(self._client, config, on_error=self._redis_error,
                                    on_fenced=self._on_fenced)
        self._heartbeat = HeartbeatThread(self._client, config, on_fenced=self._on_fenced)
        self._aborts = AbortListener(self._client, config)
        self._adapters = AdapterSync(self._client, config, engine)
        self._stopping = threading.Event()
        self._backoff = Backoff(config.max_backoff_s)
        self._claimer = Claimer(self._client, config)
        self._retry_claim_at = 0.0
        self._next_poll_at = 0.0  # a busy worker's next look at the streams
        self._follow_check = FollowCheck()
        self._held = HeldRequests(engine, config, self._spans, self._heartbeat, self._metrics)
        self._running, self._parked = self._held.running, self._held.parked  # the same objects, not copies

    def stop(self) -> None:
        """Stop claiming; `run` finishes what runs (up to drain_timeout_s) and returns.

        Safe to call from a signal handler or another thread.
        """
        self._stopping.set()

    @property
    def num_finished(self) -> int:
        """Requests finished since start."""
        return self._held.num_finished

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def is_fenced(self) -> bool:
        """This worker was judged dead and its requests queued again: it dropped them all and stopped."""
        return self._fenced.is_set()

    def _on_fenced(self) -> None:
        self._fenced.set()
        self._stopping.set()

    def run(self) -> None:
        # the first heartbeat describes the worker
        self._heartbeat.set_load(heartbeat_fields(self.config, self.engine.stats(), 0, 0,
                                                  self.engine.adapters))
        self._metrics_server.start()
        self._heartbeat.start()
        self._publisher.start()
        self._aborts.start()
        log.info("worker %s consuming %s", self.config.worker_id,
                 ", ".join(self.keys.claim_streams(self.config.consumer_name)))
        try:
            while not self._stopping.is_set():
                self._run_once(can_claim=True)
            if self.is_fenced:
                self._drop_all()
            else:
                self._drain()
        except Exception:
            # An engine bug: answer every caller and release the entries, then crash loudly.
            log.exception("worker failed; failing %d running requests", len(self._running))
            for tracked in self._running.values():
                self._held.reject(tracked, ErrorCode.ERROR_CODE_INTERNAL, "the worker failed")
            self._running.clear()
            self._publisher.submit(self._held.take_outbox())
            raise
        finally:
            self._aborts.close()
            self._publisher.close()  # its last round acknowledged what ended
            self._heartbeat.close()
            self._metrics_server.stop()
            self.tracing.shutdown()
        log.info("worker %s stopped after %d requests", self.config.worker_id, self.num_finished)

    def reload_adapters(self) -> None:
        """Re-read the adapters hash between two steps (SIGHUP; worker/io/adapters.py)."""
        self._aborts.adapters_changed.set()

    def _run_once(self, *, can_claim: bool) -> None:
        if self._aborts.adapters_changed.is_set():  # a failed read is retried at the resubscription
            self._aborts.adapters_changed.clear()
            self._adapters.sync()
        self._apply_aborts()
        self._poll_parked()
        if can_claim:
            self._claim()
        if self.engine.has_unfinished():
            self._step()
        self._flush()

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        if self._metrics is not None:
            stats = self.engine.stats()
            self._metrics.observe_step(time.perf_counter() - started, stats.num_step_prefill_tokens,
                                       stats.num_step_decode_tokens,
                                       getattr(stats, "grammar_mask_seconds", 0.0))
        self._held.emit(outputs)

    def _redis_error(self) -> None:
        if self._metrics is not None:
            self._metrics.redis_errors.inc()

    def _drain(self) -> None:
        """Finish running requests within drain_timeout_s; then hand the rest to another
        live worker (it resumes them from their progress once this worker left the registry),
        or fail them with UNAVAILABLE when no other worker is there."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.engine.has_unfinished() and time.monotonic() < deadline and not self.is_fenced:
            self._run_once(can_claim=False)
        handoff = bool(self._running or len(self._parked)) and other_workers_alive(self._client, self.config)
        if self._running:
            log.warning("drain timeout: %s %d running requests", "handing over" if handoff else "failing",
                        len(self._running))
        for key, tracked in self._running.items():
            if handoff:
                tracked.is_handed_off = True  # left pending in the group, with its progress
            else:
                tracked.error = (ErrorCode.ERROR_CODE_UNAVAILABLE, "the worker shut down before it finished")
            self.engine.abort(key)
        self._finish_aborted()
        for tracked in self._parked.take_all():
            if not handoff:  # else left pending for another worker, which parks it in turn
                self._held.end(tracked)
        self._flush()

    def _drop_all(self) -> None:
        """Fenced: every request belongs to another worker now; write nothing more for any."""
        log.error("fenced: dropping %d running and %d parked requests; stopping", len(self._running),
                  len(self._parked))
        self._count_taken_over(len(self._running) + len(self._parked))
        for key, tracked in self._running.items():
            tracked.is_handed_off = True
            self.engine.abort(key)
        self._finish_aborted()
        self._parked.take_all()
        self._held.take_outbox()  # a fenced worker writes nothing more

    def _count_taken_over(self, n: int) -> None:
        if self._metrics is not None:
            self._metrics.taken_over.inc(n)

    def _finish_aborted(self) -> None:
        for _ in range(3):  # aborted requests finish in the next step
            if not self.engine.has_unfinished():
                break
            self._step()

    # -- claiming ---------------------------------------------------------------------------------

    def _claim(self) -> None:
        is_idle = not self.engine.has_unfinished()
        count = claim_capacity(self.engine.stats())
        now = time.monotonic()
        wait = self._retry_claim_at - now
        if not is_idle and now < self._next_poll_at:
            return
        if count <= 0 or wait > 0:
            if is_idle and wait > 0:
                self._stopping.wait(wait)  # Redis is down and there is nothing to compute
            return
        max_block_ms = int(POLL_INTERVAL_S * 1000) if len(self._parked) else None  # to notice a resume
        try:
            held = set(self._running) | self._parked.keys()
            entries = self._claimer.take(count, is_idle=is_idle, max_block_ms=max_block_ms, held=held)
            stats = self.engine.stats()
            owned, followed = self._claimer.own(entries, stats.num_blocks * stats.block_size)
            self._backoff.reset()
        except redis.RedisError as e:
            delay = self._backoff.failed()
            log.warning("claiming failed (%s); retrying in %.2fs", e, delay)
            self._retry_claim_at = time.monotonic() + delay
            self._redis_error()
            return
        if not entries:  # else look again at once: more of a burst may be arriving
            self._next_poll_at = now + self.config.claim_poll_ms / 1000
        for claimed in entries:
            self._take(claimed, owned.get(claimed.key), followed)

    def _take(self, claimed: Claimed, owned: Owned | None, followed: dict[str, int]) -> None:
        qr = claimed.request
        if qr is None or owned is None:
            return self._held.outbox.ack(claimed.stream, claimed.entry_id)  # unreadable: nobody to answer
        if owned.state == "busy":  # reconciliation looks again: its owner may finish it or be fenced
            log.warning("request %s is held by another live worker; left pending", qr.request_id)
            return None
        tracked = Tracked.of(self.keys, claimed.stream, claimed.entry_id, qr, owned.progress, owned.chunks)
        if owned.state != "own":  # its final is logged, or another attempt replaced it: done
            return self._held.outbox.ack(claimed.stream, claimed.entry_id)
        if owned.num_deliveries >= self.config.max_deliveries:
            self._held.reject(tracked, ErrorCode.ERROR_CODE_UNAVAILABLE,
                              f"{owned.num_deliveries} workers stopped while running this request (limit "
                              "--max-deliveries); not trying again")
        elif not followed.get(tracked.channel):
            self._held.park(tracked)  # its caller left while it was queued: compute nothing
        else:
            self._held.admit(tracked)

    # -- aborts and parked requests --------------------------------------------------

    def _apply_aborts(self) -> None:
        """Park what nobody follows (parking.FollowCheck); abort what passed its deadline."""
        try:
            unfollowed = self._follow_check.unfollowed(self._client, self._running, self._aborts.drain())
        except redis.RedisError as e:  # asked again at the next check
            log.warning("could not count the listeners of the running requests: %s", e)
            self._redis_error()
            unfollowed = []
        for key in unfollowed:
            self._running[key].is_parking = True
            self.engine.abort(key)  # the next step returns its ABORT output
        now = self._heartbeat.redis_now()
        for key, tracked in self._running.items():
            if tracked.error is None and tracked.is_past_deadline(now):
                tracked.error = (ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED, "deadline passed while generating")
                self.engine.abort(key)

    def _poll_parked(self) -> None:
        try:
            resumed, expired = self._parked.poll(self._client)
        except redis.RedisError as e:
            log.warning("could not poll the parked requests: %s", e)
            self._redis_error()
            return
        for tracked in resumed:
            log.info("request %s is followed again: resuming it", tracked.request_id,
                     extra=self._spans.log_fields(tracked))
            self._held.admit(tracked.again())
        for tracked in expired:
            log.info("request %s: nobody resumed it within %.1fs; abandoned", tracked.request_id,
                     self._parked.grace_s, extra=self._spans.log_fields(tracked))
            self._held.end(tracked)

    def _flush(self) -> None:
        stats = self.engine.stats()
        self._heartbeat.set_load(heartbeat_fields(self.config, stats, self.num_finished, len(self._parked),
                                                  self.engine.adapters))
        if self._metrics is not None:
            self._metrics.update(stats, len(self._parked))
        now = time.monotonic()
        self._held.expire(now)
        outbox = self._held.outbox
        outbox.ends += self._publisher.take_left(now)  # ended; no gateway saw them held here yet
        if outbox and not self.is_fenced:
            outbox.room = max(0, stats.max_num_seqs - stats.num_running - stats.num_waiting)
            self._publisher.submit(self._held.take_outbox())
