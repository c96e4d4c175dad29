"""What the worker does with each request it holds (worker/io/held.py), round by round, read
from the writes it puts in the round's Outbox: admission, chunks by stream_interval, the final,
refusals, the parking cap, and when a finished request's log is dropped."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from protos.convert import build_request
from protos.keys import Keys, LogField
from protos.tokenrelay.v1 import generate_pb2, queue_pb2
from protos.tracing import WORKER_SERVICE, Tracing
from tests.factories import CountingEngine
from worker.config import WorkerConfig
from worker.io.held import HeldRequests
from worker.io.redis_io import Heartbeat
from worker.io.tracing import RequestSpans
from worker.io.tracked import Tracked

KEYS = Keys("held").for_model("m")
ErrorCode = queue_pb2.ErrorCode
MakeHeld = Callable[..., tuple[HeldRequests, CountingEngine]]


@pytest.fixture
def make_held(client: redis.Redis) -> MakeHeld:
    """HeldRequests over a CountingEngine (one "x" per step); the heartbeat only tells Redis's
    clock (its thread never starts)."""
    def make(**fields: object) -> tuple[HeldRequests, CountingEngine]:
        config = WorkerConfig(key_prefix="held", worker_id="w", **fields)  # type: ignore[arg-type]
        engine = CountingEngine(num_prompt_tokens=2)
        spans = RequestSpans(Tracing("", WORKER_SERVICE, "w"), "w")
        return HeldRequests(engine, config, spans, Heartbeat(client, config), None), engine
    return make


def tracked(request_id: str, entry_ms: int | None = None, timeout_s: float = 0.0,
            **params: object) -> Tracked:
    """A claimed entry (enqueued at entry_ms, Redis's clock: now by default) of a request."""
    entry = f"{int(time.time() * 1000) if entry_ms is None else entry_ms}-0".encode()
    request = queue_pb2.QueuedRequest(request_id=request_id, request=build_request("hi", **params),
                                      result_ttl_s=60, timeout_s=timeout_s)
    return Tracked.of(KEYS, KEYS.requests, entry, request)


def run(held: HeldRequests, engine: CountingEngine) -> list[queue_pb2.TokenEvent]:
    """Step the engine until it is done; every event the rounds logged, in order."""
    events: list[queue_pb2.TokenEvent] = []
    while engine.has_unfinished():
        held.emit(engine.step())
        for logged in held.take_outbox().logged.values():
            events += logged
    return events


@pytest.mark.parametrize(("interval", "sizes"), [(None, [1] * 7), (3, [1, 3, 3]), (4, [1, 4, 2]),
                                                 (64, [1, 6])])
def test_chunks_follow_the_stream_interval_then_the_final_has_the_whole_text(
        make_held: MakeHeld, interval: int | None, sizes: list[int]) -> None:
    held, engine = make_held()
    held.admit(tracked("r", max_tokens=7, stream_interval=interval))
    admitted = held.take_outbox()
    assert admitted.admitted == {"r": 2} and "r" in admitted.progress  # billed; the seed is known
    events = run(held, engine)
    chunks, final = events[:-1], events[-1]
    assert [len(e.chunk.token_ids) for e in chunks] == sizes
    assert [e.seq for e in events] == list(range(len(sizes) + 1))
    assert final.final.text == "x" * 7 and final.final.usage.completion_tokens == 7
    assert final.final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert held.num_finished == 1 and not held.running


def test_a_finished_requests_log_is_dropped_after_its_result_ttl(make_held: MakeHeld) -> None:
    held, engine = make_held()
    held.admit(tracked("r", max_tokens=2))
    held.take_outbox()
    held.emit(engine.step())
    held.emit(engine.step())
    ends = held.take_outbox().ends
    assert [(e.request_id, e.final_seq) for e in ends] == [("r", 2)]
    held.expire(time.monotonic() + 59)
    assert held.outbox.drops == []
    held.expire(time.monotonic() + 61)
    assert held.outbox.drops == LogField.all_of("r", 3)  # two chunks and the final
    held.expire(time.monotonic() + 120)
    assert held.outbox.drops == LogField.all_of("r", 3)  # once


def test_a_request_past_its_deadline_or_with_a_bad_field_is_refused_not_run(make_held: MakeHeld) -> None:
    held, engine = make_held()
    held.admit(tracked("late", entry_ms=1_000, max_tokens=2, timeout_s=1.0))
    held.admit(tracked("bad", max_tokens=2, temperature=-1.0))
    outbox = held.take_outbox()
    codes = {e.request_id: e.error.code for e in outbox.published}
    assert codes == {"late": ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED,
                     "bad": ErrorCode.ERROR_CODE_INVALID_ARGUMENT}
    assert sorted(e.request_id for e in outbox.ends) == ["bad", "late"]  # acknowledged
    assert not held.running and not engine.has_unfinished()


def test_a_second_claim_of_a_running_entry_is_ignored(make_held: MakeHeld) -> None:
    held, engine = make_held()
    first = tracked("r", max_tokens=3)
    held.admit(first)
    held.admit(Tracked.of(KEYS, first.stream, first.entry_id, first.request))
    assert list(held.running) == [first.key] and held.running[first.key] is first
    assert len(run(held, engine)) == 4  # one generation: 3 chunks and the final


def test_parks_beyond_the_cap_end_the_attempt(make_held: MakeHeld) -> None:
    held, _ = make_held(max_parked=1)
    held.park(tracked("a"))
    held.park(tracked("b"))
    assert len(held.parked) == 1 and "a" in [t.request_id for t in held.parked.take_all()]
    assert [e.request_id for e in held.take_outbox().ends] == ["b"]
