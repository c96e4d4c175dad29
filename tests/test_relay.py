"""The relay's rules (gateway/relay.py) against a scripted call queue: duplicates, gaps, resumes,
resubscriptions, errors of this attempt and others, next attempts, liveness."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from gateway.errors import DataLoss, OutOfRange, Unavailable, WorkerError
from gateway.queue import EntryState
from gateway.relay import Follow, relay
from gateway.replies import RESYNC, TICK
from protos.tokenrelay.v1 import generate_pb2, queue_pb2


class FakeQueue:
    """Liveness answers in order (then RUNNING) and a request log, as RequestQueue gives them."""

    def __init__(self, states: list[EntryState] | None = None,
                 log: dict[int, queue_pb2.TokenEvent] | None = None) -> None:
        self.states, self.log = states or [], log or {}

    async def entry_state(self, entry_id: bytes, stream: str = "") -> EntryState:
        return self.states.pop(0) if self.states else EntryState.RUNNING

    async def read_log(self, request_id: str, first_seq: int = 0) -> dict[int, queue_pb2.TokenEvent]:
        """What RequestQueue.read_log gives: from first_seq on, or the final alone past the end."""
        finals = [seq for seq, e in self.log.items() if e.HasField("final") and seq < first_seq]
        return {s: e for s, e in self.log.items() if s >= first_seq or s in finals}


ENTRY = b"1-0"  # the attempt the relayed call follows


def chunk(seq: int, entry_id: bytes = ENTRY) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", seq=seq, entry_id=entry_id,
                                chunk=generate_pb2.Chunk(index=seq, text=f"<{seq}>"))


def final(seq: int) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", seq=seq, entry_id=ENTRY,
                                final=generate_pb2.Final(text="done"))


def error(code: int, entry_id: bytes = ENTRY) -> queue_pb2.TokenEvent:
    return queue_pb2.TokenEvent(request_id="r", entry_id=entry_id,
                                error=queue_pb2.RequestError(code=code, message="worker said no"))


def test_a_resync_does_not_cancel_the_move_of_an_unclaimed_routed_attempt() -> None:
    """A resubscription (Redis restarted) while a routed attempt waits for its worker says nothing
    of whether the worker claimed it: the move to the shared stream still happens at move_at (a
    RESYNC once cancelled it, and the call waited on a worker that had left)."""
    moved: list[tuple[str, bytes]] = []

    async def go() -> list[str]:
        calls: asyncio.Queue = asyncio.Queue()
        calls.put_nowait(RESYNC)

        async def move(stream: str, entry_id: bytes) -> tuple[bytes, str]:
            moved.append((stream, entry_id))
            calls.put_nowait(chunk(0))  # a worker of the shared stream runs it
            calls.put_nowait(final(1))
            return b"2-0", "shared"

        follow = Follow("r", ENTRY, 0, stream="routed", move=move, move_at=time.monotonic() + 0.2)
        responses = relay(follow, calls, FakeQueue(), read_log=False,  # type: ignore[arg-type]
                          liveness_check_s=1.0, max_outage_s=1.0)
        async with asyncio.timeout(5):
            return [r.chunk.text if r.HasField("chunk") else "final" async for r in responses]
    assert asyncio.run(go()) == ["<0>", "final"]
    assert moved == [("routed", ENTRY)]


def run_relay(items: list, queue: FakeQueue | None = None, *, liveness_s: float = 1.0, resume_from: int = 0,
              read_log: bool = False, next_attempt: Any = None) -> list[str]:
    async def go() -> list[str]:
        calls: asyncio.Queue = asyncio.Queue()
        for item in items:
            calls.put_nowait(item)

        async def tick() -> None:  # what ReplyRouter does for every idle call
            while True:
                await asyncio.sleep(liveness_s / 2)
                if calls.empty():
                    calls.put_nowait(TICK)

        ticker = asyncio.ensure_future(tick())
        follow = Follow("r", ENTRY, resume_from, next_attempt=next_attempt)
        responses = relay(follow, calls, queue or FakeQueue(), read_log=read_log,  # type: ignore[arg-type]
                          liveness_check_s=liveness_s, max_outage_s=1.0)
        try:
            return [r.chunk.text if r.HasField("chunk") else "final" async for r in responses]
        finally:
            ticker.cancel()
    return asyncio.run(go())


def test_relay_drops_duplicate_events() -> None:
    assert run_relay([chunk(0), chunk(1), chunk(0), chunk(1), chunk(2), final(3)]) == \
        ["<0>", "<1>", "<2>", "final"]


def test_relay_replays_the_log_then_follows_live_events_without_a_duplicate() -> None:
    log = {0: chunk(0), 1: chunk(1), 2: chunk(2)}
    assert run_relay([chunk(2), chunk(3), final(4)], FakeQueue(log=log), read_log=True) == \
        ["<0>", "<1>", "<2>", "<3>", "final"]


def test_relay_skips_the_chunks_a_resuming_caller_has() -> None:
    log = {0: chunk(0), 1: chunk(1), 2: chunk(2), 3: final(3)}
    assert run_relay([], FakeQueue(log=log), read_log=True, resume_from=2) == ["<2>", "final"]
    with pytest.raises(OutOfRange, match="past the end"):
        run_relay([], FakeQueue(log=log), read_log=True, resume_from=4)


def test_relay_fills_a_gap_from_the_log_or_fails_on_it() -> None:
    assert run_relay([chunk(0), chunk(2), final(3)], FakeQueue(log={1: chunk(1)})) == \
        ["<0>", "<1>", "<2>", "final"]
    with pytest.raises(DataLoss, match="lost token events 1..1"):
        run_relay([chunk(0), chunk(2)])


def test_relay_rereads_the_log_after_a_resubscription() -> None:
    log = {0: chunk(0), 1: chunk(1)}  # published while the gateway was not subscribed
    assert run_relay([RESYNC, chunk(2), final(3)], FakeQueue(log=log)) == ["<0>", "<1>", "<2>", "final"]


def test_relay_raises_its_attempts_error_and_ignores_other_attempts() -> None:
    other = error(queue_pb2.ERROR_CODE_INTERNAL, entry_id=b"0-1")
    with pytest.raises(WorkerError) as e:
        run_relay([chunk(0), other, chunk(1), error(queue_pb2.ERROR_CODE_INVALID_ARGUMENT)])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_earlier_callers_deadline_or_a_vanished_entry_starts_the_next_attempt() -> None:
    started: list[bytes] = []

    async def next_attempt(ended: bytes) -> tuple[bytes, str]:
        started.append(ended)
        return b"2-0", ""

    deadline = error(queue_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
    later = queue_pb2.TokenEvent(request_id="r", seq=1, entry_id=b"2-0", chunk=generate_pb2.Chunk(index=1))
    assert run_relay([chunk(0), deadline, later, final(2)], next_attempt=next_attempt) == ["<0>", "", "final"]
    assert started == [ENTRY]
    # The entry left the stream without a final (abandoned while parked): the next attempt
    # resumes, and what it logs reaches the call.
    gone = FakeQueue([EntryState.GONE, EntryState.GONE])

    async def resume_attempt(ended: bytes) -> tuple[bytes, str]:
        started.append(ended)
        gone.log = {1: chunk(1, entry_id=b"3-0"), 2: final(2)}
        return b"3-0", ""

    relayed = run_relay([chunk(0)], gone, liveness_s=0.02, next_attempt=resume_attempt)
    assert relayed == ["<0>", "<1>", "final"]
    assert started == [ENTRY, ENTRY]


def test_relay_gives_up_after_too_many_attempts() -> None:
    async def next_attempt(ended: bytes) -> tuple[bytes, str]:
        return ended, ""

    start = time.monotonic()
    with pytest.raises(Unavailable, match="left the queue without an answer"):
        run_relay([chunk(0)], FakeQueue([EntryState.GONE] * 20), liveness_s=0.02, next_attempt=next_attempt)
    assert time.monotonic() - start < 1


def test_relay_keeps_waiting_while_queued_running_or_waiting_to_be_resumed() -> None:
    # ORPHANED: its worker died; a sweep queues it again, another worker resumes it (protos/keys.py)
    states = [EntryState.QUEUED, EntryState.RUNNING, EntryState.ORPHANED, EntryState.ORPHANED,
              EntryState.QUEUED, EntryState.GONE, EntryState.GONE]
    with pytest.raises(Unavailable, match="left the queue"):
        run_relay([], FakeQueue(states), liveness_s=0.02)
