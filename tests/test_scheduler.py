"""Admission policy: FIFO into free slots under a prompt-token budget (no model)."""

from __future__ import annotations

from protos.params import FinishReason, SamplingParams
from worker.kv_cache import KVCacheManager
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.stopping import StoppingCriteria


def make_seq(request_id: str, num_tokens: int) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence(request_id, [5] * num_tokens, params, seed=0,
                    stopping=StoppingCriteria(params, frozenset(), 4))


def make_scheduler(num_slots: int = 4, budget: int = 100) -> Scheduler:
    return Scheduler(KVCacheManager(num_slots, max_len=1000), max_prefill_tokens=budget)


def test_admits_fifo_until_slots_run_out() -> None:
    s = make_scheduler(num_slots=2)
    for i in range(3):
        s.add(make_seq(f"r{i}", 10))
    out = s.schedule()
    assert [q.request_id for q in out.prefills] == ["r0", "r1"] and s.num_waiting == 1


def test_prefill_budget_bounds_a_step_but_never_starves_a_long_prompt() -> None:
    s = make_scheduler(budget=100)
    s.add(make_seq("long", 500))
    s.add(make_seq("a", 60))
    assert [q.request_id for q in s.schedule().prefills] == ["long"]
    s.add(make_seq("b", 60))
    assert [q.request_id for q in s.schedule().prefills] == ["a"]  # a + b > budget


def test_decodes_are_prefilled_sequences_sorted_by_slot() -> None:
    s = make_scheduler()
    for i in range(3):
        s.add(make_seq(f"r{i}", 5))
    for q in s.schedule().prefills:
        q.num_computed_tokens = 5
        q.output_ids.append(1)
    s.finish(s.running["r1"], FinishReason.EOS)
    s.add(make_seq("r3", 5))
    out = s.schedule()
    assert [q.request_id for q in out.prefills] == ["r3"] and out.prefills[0].slot == 1
    assert [(q.request_id, q.slot) for q in out.decodes] == [("r0", 0), ("r2", 2)]


def test_finish_frees_slot_and_removes_waiting() -> None:
    s = make_scheduler(num_slots=1)
    s.add(make_seq("a", 5))
    s.add(make_seq("b", 5))
    s.schedule()
    s.finish(s.waiting[0], FinishReason.ABORT)
    s.finish(s.running["a"], FinishReason.ABORT)
    assert not s.has_unfinished() and s.kv.num_free_slots == 1
