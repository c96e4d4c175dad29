"""Turn one call's worker events into `GenerateResponse`s, in order, or an error.

Events carry the stream entry id of their attempt and a per-attempt `seq`: an
event of another attempt under the same request id (a retry after a cancel) is
dropped, so is a duplicate (a worker resent a pipeline after a Redis hiccup), and
a gap fails the call. A call that hears nothing for
`liveness_check_s` asks Redis whether its request is still in the stream, so a
lost entry (Redis restarted empty) ends the call instead of hanging it. An entry
whose worker crashed stays: another worker re-claims it and resumes the stream
where it stopped (protos/keys.py), so the call waits for it like for a queued
request, bounded by its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from gateway.errors import GatewayError, Unavailable, WorkerError, redis_unavailable
from gateway.queue import EntryState, RequestQueue
from gateway.replies import CallItem
from protos.tokenrelay.v1 import generate_pb2

# Consecutive bad liveness checks before giving up: the first may race with a
# final event that is already on its way (XDEL lands right after the PUBLISH).
MAX_BAD_CHECKS = 2


async def relay(request_id: str, entry_id: bytes, calls: asyncio.Queue[CallItem], queue: RequestQueue,
                liveness_check_s: float) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yield the chunks, then the final message; raise GatewayError on failure."""
    next_seq = 0
    num_bad_checks = 0
    while True:
        try:
            async with asyncio.timeout(liveness_check_s):
                item = await calls.get()
        except TimeoutError:
            num_bad_checks = await _check_alive(entry_id, queue, num_bad_checks)
            continue
        if isinstance(item, GatewayError):
            raise item
        if item.entry_id != entry_id:
            continue  # an earlier attempt under this request id (a retry after a cancel)
        if item.seq < next_seq:
            continue  # duplicate of an event already relayed
        if item.seq > next_seq:
            raise Unavailable(f"lost token events {next_seq}..{item.seq - 1} of request {request_id}")
        next_seq += 1
        num_bad_checks = 0
        kind = item.WhichOneof("kind")
        if kind == "chunk":
            yield generate_pb2.GenerateResponse(request_id=request_id, chunk=item.chunk)
        elif kind == "final":
            yield generate_pb2.GenerateResponse(request_id=request_id, final=item.final)
            return
        else:
            raise WorkerError(item.error)


async def _check_alive(entry_id: bytes, queue: RequestQueue, num_bad_checks: int) -> int:
    """Returns the new count of consecutive bad checks; raises once it is too many."""
    try:
        state = await queue.entry_state(entry_id)
    except RedisError as e:
        raise redis_unavailable(e) from e
    if state is not EntryState.GONE:  # ORPHANED: a live worker will re-claim and resume it
        return 0
    if num_bad_checks + 1 < MAX_BAD_CHECKS:
        return num_bad_checks + 1
    raise Unavailable("the request left the queue without an answer (was Redis restarted?); retry")
