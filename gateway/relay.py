"""Follow one request's events and turn them into `GenerateResponse`s, in order.

Events come from two places (protos/keys.py): the request's log in its record,
read once the call is subscribed (and again after a resubscription or a gap),
and its channel. Both carry a per-request `seq`, which is also the chunk index
(the final's seq is the number of chunks): duplicates are dropped, and a gap
the log cannot fill fails the call with DATA_LOSS (Redis lost what it had
acknowledged: a retry cannot help, so the shipped client does not retry it). A
call resuming at chunk K starts at seq K, so what the caller already has is
neither sent nor needed.

An error event ends only its attempt, so the call accepts errors of the attempt
it follows alone. Two ways an attempt ends without an answer are not the
caller's problem and start the next attempt (it resumes from the record's
progress, with the same seed): its entry left the stream without a final (the
worker abandoned a parked request, or Redis lost the entry), and a deadline
that was the earlier caller's, not this one's.

A call that hears nothing for `liveness_check_s` asks Redis whether its entry
is still queued or held by a live worker (at the router's next TICK after that).
While Redis is unreachable it keeps waiting, up to `max_outage_s`; the router
resubscribes when Redis is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from gateway.errors import DataLoss, GatewayError, OutOfRange, Unavailable, WorkerError, redis_unavailable
from gateway.queue import EntryState, RequestQueue
from gateway.replies import CallItem, Full, Resync, Tick
from protos.tokenrelay.v1 import generate_pb2, queue_pb2

# Consecutive GONE answers before the attempt counts as ended: the first may race with
# a final already on its way (XDEL lands right after it in the same pipeline).
MAX_BAD_CHECKS = 2
MAX_ATTEMPTS_PER_CALL = 3  # new attempts one call may start before it gives up
# How long the attempt a gap made the call start again may take to regenerate the lost
# events (claim, prefill, decode up to the gap) before the gap fails the call.
REGENERATE_GRACE_S = 10.0


@dataclass
class Follow:
    """What one call follows, and how far it got."""

    request_id: str  # the request's key in Redis: tenant-scoped (Tenant.request_key)
    entry_id: bytes  # the attempt whose errors count
    resume_from: int = 0  # chunks the caller already has: the first seq to relay
    stream: str = ""  # the stream the attempt is in ("" = the NORMAL class's shared one)
    # Start the next attempt after `entry_id` ended without an answer; returns the entry to
    # follow and its stream, or None when the request turned out finished (its final is in
    # the log).
    next_attempt: Callable[[bytes], Awaitable[tuple[bytes, str] | None]] | None = None
    # An attempt routed to a worker's own stream (gateway/routing.py): at `move_at` (monotonic)
    # with nothing heard yet, `move(stream, entry)` takes it to the shared stream unless a
    # worker claimed it (the new entry and stream, or None).
    move: Callable[[str, bytes], Awaitable[tuple[bytes, str] | None]] | None = None
    move_at: float | None = None
    # Seconds left of this call's deadline (None = no deadline).
    time_remaining: Callable[[], float | None] = lambda: None
    next_seq: int = -1  # -1: resume_from
    gap_deadline: float | None = None  # monotonic: a gap the log could not fill fails the call then
    num_attempts: int = 0
    pending: dict[int, queue_pb2.TokenEvent] = field(default_factory=dict)  # seq -> event, not yet relayed
    caller_id: str = ""  # the request_id the caller knows ("" = request_id): in responses and errors

    def __post_init__(self) -> None:
        self.caller_id = self.caller_id or self.request_id


async def relay(follow: Follow, calls: asyncio.Queue[CallItem], queue: RequestQueue, *, read_log: bool,
                liveness_check_s: float, max_outage_s: float) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yield the chunks from `resume_from` on, then the final message; raise GatewayError on failure."""
    checks = _Liveness(queue, max_outage_s)
    follow.next_seq = follow.resume_from if follow.next_seq < 0 else follow.next_seq
    if read_log:
        await _fill_from_log(follow, queue)
    heard_at = time.monotonic()  # the last item; TICKs (replies.py) tell how long ago that was
    while True:
        while follow.next_seq in follow.pending:
            event = follow.pending.pop(follow.next_seq)
            follow.next_seq += 1
            checks.reset()
            if event.HasField("chunk"):
                yield generate_pb2.GenerateResponse(request_id=follow.caller_id, chunk=event.chunk)
            else:
                yield generate_pb2.GenerateResponse(request_id=follow.caller_id, final=event.final)
                return
        if follow.next_seq in follow.pending:
            follow.gap_deadline = None
        elif follow.gap_deadline is not None and time.monotonic() > follow.gap_deadline:
            await _fill_gap(follow, queue, checks, grace_s=0)
        if follow.move_at is not None:
            try:
                item = await asyncio.wait_for(calls.get(), max(0.0, follow.move_at - time.monotonic()))
            except TimeoutError:
                await _move(follow)
                continue
            if isinstance(item, Full):  # its worker has no room: it would wait for a slot there
                await _move(follow)
                continue
            if not isinstance(item, Tick | Resync):  # a resubscription says nothing of the claim
                follow.move_at = None  # a worker has it (or the call ends): it stays where it is
        else:
            item = await calls.get()
        if isinstance(item, Full):  # too late: a worker took the attempt
            continue
        if isinstance(item, Tick):
            if follow.gap_deadline is not None or time.monotonic() - heard_at < liveness_check_s:
                continue  # a gap is judged above
            heard_at = time.monotonic()
            if await checks.has_ended(follow.entry_id, follow.stream):
                await _start_next_attempt(follow, queue)
            continue
        heard_at = time.monotonic()
        if isinstance(item, GatewayError):
            raise item
        if isinstance(item, Resync):
            await _fill_from_log(follow, queue, checks)
        elif item.HasField("error"):
            if item.entry_id == follow.entry_id:
                await _on_error(follow, queue, item.error)
        else:
            _add(follow, item)
            if item.seq > follow.next_seq:
                await _fill_gap(follow, queue, checks, grace_s=liveness_check_s)


def _add(follow: Follow, event: queue_pb2.TokenEvent) -> None:
    if event.seq >= follow.next_seq:
        follow.pending.setdefault(event.seq, event)
    elif event.HasField("final"):  # only a caller resuming past the end is beyond the final
        raise OutOfRange(f"resume_from_index ({follow.resume_from}) is past the end of the stream: "
                         f"request {follow.caller_id} finished after {event.seq} chunks")


async def _fill_from_log(follow: Follow, queue: RequestQueue, checks: _Liveness | None = None) -> bool:
    """Add what the log has from next_seq on; False if Redis did not answer (and `checks`
    allows more waiting: the router resubscribes once it is back, and this runs again)."""
    try:
        log = await queue.read_log(follow.request_id, follow.next_seq)
    except RedisError as e:
        if checks is None:
            raise redis_unavailable(e) from e
        checks.failed(e)
        return False
    for event in log.values():
        _add(follow, event)
    return True


async def _fill_gap(follow: Follow, queue: RequestQueue, checks: _Liveness, *, grace_s: float) -> None:
    """A live event came after a gap: the missing ones must be in the log (a worker logs an
    event before it publishes it), or Redis lost them. A gap the log cannot fill fails the call
    after grace_s, or, when Redis lost the attempt's entry too (it came back empty), after the
    next attempt (started at once, same seed) had time to regenerate the lost events."""
    if await _fill_from_log(follow, queue, checks) and follow.next_seq not in follow.pending:
        if follow.gap_deadline is None and grace_s > 0:
            follow.gap_deadline = time.monotonic() + grace_s
            try:
                is_gone = await queue.entry_state(follow.entry_id, follow.stream) is EntryState.GONE
            except RedisError as e:
                raise redis_unavailable(e) from e
            if is_gone:
                follow.gap_deadline = time.monotonic() + REGENERATE_GRACE_S
                await _start_next_attempt(follow, queue)
            return
        if follow.gap_deadline is not None and time.monotonic() <= follow.gap_deadline:
            return
        first = min(follow.pending)
        raise DataLoss(f"lost token events {follow.next_seq}..{first - 1} of request {follow.caller_id} "
                       "(Redis lost them, say in a failover); the stream cannot continue without a gap, "
                       "and resending cannot bring them back: start a new request")


async def _move(follow: Follow) -> None:
    """Routing was a preference: the attempt's worker did not claim it in time."""
    follow.move_at = None
    if follow.move is None:
        return
    try:
        moved = await follow.move(follow.stream, follow.entry_id)
    except RedisError:
        return  # it stays routed; the liveness checks watch it as any other attempt
    if moved is not None:
        follow.entry_id, follow.stream = moved


async def _on_error(follow: Follow, queue: RequestQueue, error: queue_pb2.RequestError) -> None:
    remaining = follow.time_remaining()
    is_earlier_deadline = (error.code == queue_pb2.ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED
                           and (remaining is None or remaining > 0))
    if not is_earlier_deadline:
        raise WorkerError(error)
    await _start_next_attempt(follow, queue)  # the deadline was an earlier caller's


async def _start_next_attempt(follow: Follow, queue: RequestQueue) -> None:
    follow.num_attempts += 1
    if follow.next_attempt is None or follow.num_attempts > MAX_ATTEMPTS_PER_CALL:
        raise Unavailable(f"request {follow.caller_id} left the queue without an answer "
                          f"{follow.num_attempts} times (was Redis restarted without its data?); retry")
    try:
        found = await follow.next_attempt(follow.entry_id)
    except RedisError as e:
        raise redis_unavailable(e) from e
    if found is not None:
        follow.entry_id, follow.stream = found
    await _fill_from_log(follow, queue)


class _Liveness:
    """Liveness checks of one call: consecutive GONE answers, and how long Redis has been down."""

    def __init__(self, queue: RequestQueue, max_outage_s: float) -> None:
        self._queue, self._max_outage_s = queue, max_outage_s
        self._num_gone = 0
        self._down_since: float | None = None

    def reset(self) -> None:
        self._num_gone = 0
        self._down_since = None

    def failed(self, e: RedisError) -> None:
        now = time.monotonic()
        self._down_since = self._down_since or now
        if now - self._down_since > self._max_outage_s:
            raise redis_unavailable(e) from e

    async def has_ended(self, entry_id: bytes, stream: str) -> bool:
        """True once the entry has been GONE MAX_BAD_CHECKS times in a row."""
        try:
            state = await self._queue.entry_state(entry_id, stream)
        except RedisError as e:
            self.failed(e)
            return False
        self._down_since = None
        if state is not EntryState.GONE:  # ORPHANED: a sweep queues it again, another worker resumes it
            self._num_gone = 0
            return False
        self._num_gone += 1
        if self._num_gone < MAX_BAD_CHECKS:
            return False
        self._num_gone = 0
        return True
