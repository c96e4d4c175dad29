"""Admission policy: FIFO into free slots under a prompt-token budget (no model)."""

from __future__ import annotations

from protos.params import FinishReason, SamplingParams
from worker.engine.kv_cache import KVCacheManager
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.sequence import Sequence
from worker.engine.stopping import StoppingCriteria


def make_seq(request_id: str, num_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence(request_id, [5] * num_tokens, params, seed=0,
                    stopping=StoppingCriteria(params, frozenset(), 4))


def make_scheduler(num_slots: int = 4, budget: int = 100) -> Scheduler:
    return Scheduler(KVCacheManager(num_slots, max_len=1000), max_prefill_tokens=budget)


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num tokens) of each prompt chunk; marks them computed, as the runner does."""
    for c in out.prefills:
        c.seq.num_computed_tokens = c.start + c.num_tokens
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.prefills]


def test_admits_fifo_until_slots_run_out() -> None:
    s = make_scheduler(num_slots=2)
    for i in range(3):
        s.add(make_seq(f"r{i}", 10))
    assert chunks(s.schedule()) == [("r0", 0, 10), ("r1", 0, 10)] and s.num_waiting == 1


def test_prompts_beyond_the_budget_are_prefilled_in_chunks_older_first() -> None:
    s = make_scheduler(budget=100)
    s.add(make_seq("long", 250))
    s.add(make_seq("a", 60))
    assert chunks(s.schedule()) == [("long", 0, 100)]
    assert chunks(s.schedule()) == [("long", 100, 100)]
    s.add(make_seq("b", 30))
    out = s.schedule()
    assert chunks(out) == [("long", 200, 50), ("a", 0, 50)]
    assert [c.is_last for c in out.prefills] == [True, False]
    assert chunks(s.schedule()) == [("a", 50, 10), ("b", 0, 30)]


def test_a_long_prompt_never_stops_the_running_streams() -> None:
    s = make_scheduler(budget=64)
    s.add(make_seq("running", 8))
    chunks(s.schedule())
    s.running["running"].output_ids.append(1)
    s.add(make_seq("long", 1000))
    for _ in range(1000 // 64):
        out = s.schedule()
        assert [q.request_id for q in out.decodes] == ["running"]
        assert sum(n for _, _, n in chunks(out)) == 64


def test_decodes_are_prefilled_sequences_sorted_by_slot() -> None:
    s = make_scheduler()
    for i in range(3):
        s.add(make_seq(f"r{i}", 5))
    for c in s.schedule().prefills:
        c.seq.num_computed_tokens = 5
        c.seq.output_ids.append(1)
    s.finish(s.running["r1"], FinishReason.EOS)
    s.add(make_seq("r3", 5))
    out = s.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["r3"] and out.prefills[0].seq.slot == 1
    assert [(q.request_id, q.slot) for q in out.decodes] == [("r0", 0), ("r2", 2)]


def test_finish_frees_slot_and_removes_waiting() -> None:
    s = make_scheduler(num_slots=1)
    s.add(make_seq("a", 5))
    s.add(make_seq("b", 5))
    s.schedule()
    s.finish(s.waiting[0], FinishReason.ABORT)
    s.finish(s.running["a"], FinishReason.ABORT)
    assert not s.has_unfinished() and s.kv.num_free_slots == 1
