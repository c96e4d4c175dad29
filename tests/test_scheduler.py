"""Admission, chunked prefill and preemption over KV blocks (no model)."""

from __future__ import annotations

import itertools
import re

import pytest

from protos.params import FinishReason, SamplingParams
from worker.engine.kv_manager import KVCacheManager
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.stopping import StoppingCriteria

_distinct = itertools.count(1000)


def make_seq(request_id: str, num_tokens: int, prompt: list[int] | None = None) -> Sequence:
    """A request; without `prompt`, tokens no other request shares (no prefix hits)."""
    params = SamplingParams(max_tokens=64)
    prompt = prompt or [next(_distinct) for _ in range(num_tokens)]
    return Sequence(request_id, prompt, params, seed=0,
                    stopping=StoppingCriteria(params, frozenset(), 64))


def make_scheduler(num_blocks: int = 1000, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 100, max_num_batched_tokens: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len=1000)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_prefill_tokens=budget,
                     max_num_batched_tokens=max_num_batched_tokens)


def run(s: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    """What the engine does after the model ran: commit the step, append each new token."""
    s.commit(out)
    for seq in [c.seq for c in out.prefills if c.is_last] + out.decodes:
        seq.output_ids.append(token)


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.prefills]


def test_admits_fifo_up_to_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(f"r{i}", 10))
    assert chunks(s.schedule()) == [("r0", 0, 10), ("r1", 0, 10)] and s.num_waiting == 1


def test_admits_while_prompt_blocks_fit_keeping_one_per_running_request() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    for i in range(3):
        s.add(make_seq(f"r{i}", 10, prompt=[10 * i + j for j in range(10)]))  # 3 blocks each
    # r0 takes 3 (reserve 0), r1 needs 3 + 1 reserved of the 5 left; r2 would need 3 + 2 of 2
    assert [c[0] for c in chunks(s.schedule())] == ["r0", "r1"]
    assert s.kv.num_free_blocks == 2 and s.num_waiting == 1


def test_prompts_beyond_the_budget_are_prefilled_in_chunks_older_first() -> None:
    s = make_scheduler(budget=100)
    s.add(make_seq("long", 250))
    s.add(make_seq("a", 60, prompt=list(range(60))))
    out = s.schedule()
    assert chunks(out) == [("long", 0, 100)]
    run(s, out)
    out = s.schedule()
    assert chunks(out) == [("long", 100, 100)]
    run(s, out)
    s.add(make_seq("b", 30, prompt=list(range(100, 130))))
    out = s.schedule()
    assert chunks(out) == [("long", 200, 50), ("a", 0, 50)]
    assert [c.is_last for c in out.prefills] == [True, False]
    run(s, out)
    out = s.schedule()
    assert chunks(out) == [("a", 50, 10), ("b", 0, 30)] and [q.request_id for q in out.decodes] == ["long"]


def test_a_long_prompt_never_stops_the_running_streams() -> None:
    s = make_scheduler(budget=64)
    s.add(make_seq("running", 8))
    run(s, s.schedule())
    s.add(make_seq("long", 900, prompt=[7] * 900))
    for _ in range(900 // 64):
        out = s.schedule()
        assert [q.request_id for q in out.decodes] == ["running"]
        assert sum(n for _, _, n in chunks(out)) == 64
        run(s, out)


def test_decodes_are_the_prefilled_running_sequences_in_admission_order() -> None:
    s = make_scheduler()
    for i in range(3):
        s.add(make_seq(f"r{i}", 5, prompt=[i] * 5))
    run(s, s.schedule())
    s.finish(s.running["r1"], FinishReason.EOS)
    s.add(make_seq("r3", 5, prompt=[3] * 5))
    out = s.schedule()
    assert chunks(out) == [("r3", 0, 5)] and [q.request_id for q in out.decodes] == ["r0", "r2"]


def test_finish_frees_the_blocks_and_removes_a_waiting_request() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add(make_seq("a", 5))
    s.add(make_seq("b", 5))
    s.schedule()
    s.finish(s.waiting[0], FinishReason.ABORT)
    s.finish(s.running["a"], FinishReason.ABORT)
    assert not s.has_unfinished() and s.kv.num_free_blocks == s.kv.num_blocks


def test_out_of_blocks_preempts_the_newest_which_resumes_first_with_its_tokens() -> None:
    s = make_scheduler(num_blocks=6, block_size=4)
    s.add(make_seq("old", 8, prompt=list(range(8))))  # 2 blocks
    s.add(make_seq("new", 8, prompt=list(range(20, 28))))  # 2 blocks, 1 reserved for old
    out = s.schedule()
    run(s, out, token=100)  # both prefilled; each has 9 tokens, needing a 3rd block at the next step
    s.add(make_seq("later", 4, prompt=[9] * 4))
    out = s.schedule()  # old grows into block 5, new into block 6
    assert [q.request_id for q in out.decodes] == ["old", "new"] and not out.preempted
    run(s, out, token=101)
    for _ in range(3):
        out = s.schedule()
        run(s, out, token=102)
    out = s.schedule()  # 13 tokens each: 4th blocks needed, none left: new (the newest) goes
    assert [q.request_id for q in out.decodes] == ["old"] and [q.request_id for q in out.preempted] == ["new"]
    assert not out.prefills  # nothing is admitted in a step that preempted
    new = s.waiting[0]
    assert new.request_id == "new" and new.status is SequenceStatus.WAITING and s.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.num_recomputed_tokens == len(new.output_ids) == 5
    assert new.prefill_ids == list(range(20, 28)) + [100, 101, 102, 102, 102]
    assert not s.kv.has("new") and s.kv.num_free_blocks == 2  # new's 3 freed, old took one
    s.finish(s.running["old"], FinishReason.EOS)
    out = s.schedule()  # resumed ahead of "later"; old's new block evicted new's tail block, not its head
    assert chunks(out)[0] == ("new", 8, 5) and out.prefills[0].is_last


def test_a_preempted_resumed_request_recomputes_its_carried_over_and_its_own_tokens() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add(make_seq("old", 3, prompt=[7, 8, 9]))  # 1 block
    seq = make_seq("r", 4, prompt=[1, 2, 3, 4])
    seq.output_ids, seq.num_carried_over_tokens = [50, 51], 2  # streamed by an earlier worker
    s.add(seq)
    out = s.schedule()
    assert chunks(out) == [("old", 0, 3), ("r", 0, 6)]  # the carried-over tokens are prefilled
    for token in (60, 61, 62):
        run(s, out, token)
        out = s.schedule()
    assert out.preempted == [seq]  # 9 tokens need a 3rd block; old took the last one
    assert (seq.num_carried_over_tokens, seq.num_recomputed_tokens) == (2, 3)
    assert seq.prefill_ids == [1, 2, 3, 4, 50, 51, 60, 61, 62] and seq.num_prefill_tokens == 9


def test_a_prompt_whose_prefix_another_request_computes_now_waits_one_step_for_the_hit() -> None:
    s = make_scheduler(block_size=4, budget=100)
    system = list(range(40))
    s.add(make_seq("a", 0, prompt=system + [1, 2]))
    s.add(make_seq("b", 0, prompt=system + [3, 4, 5]))
    out = s.schedule()
    assert chunks(out) == [("a", 0, 42)]  # b would otherwise compute the same 10 blocks again
    run(s, out)
    out = s.schedule()
    assert chunks(out) == [("b", 40, 3)] and s.running["b"].num_cached_tokens == 40
    assert s.kv.block_table("a")[:10] == s.kv.block_table("b")[:10]


# ---------------------------------------------------------------- the step's token budget


def decoding(s: Scheduler, *lengths: int) -> list[Sequence]:
    """Requests of these prompt lengths, prefilled and decoding."""
    seqs = [make_seq(f"d{i}", n) for i, n in enumerate(lengths)]
    for seq in seqs:
        s.add(seq)
    while any(not q.is_prefilled for q in seqs):
        run(s, s.schedule())
    return seqs


def test_decodes_and_prompt_chunks_share_the_steps_token_budget() -> None:
    s = make_scheduler(budget=100, max_num_batched_tokens=40)
    decoding(s, 5, 5, 5)  # 3 decode tokens a step
    long = make_seq("long", 90)
    s.add(long)
    sizes = []
    while not long.is_prefilled:
        out = s.schedule()
        sizes.append((len(out.decodes), sum(c.num_tokens for c in out.prefills)))
        run(s, out)
    assert sizes == [(3, 37), (3, 37), (3, 16)]  # 40 - 3 decodes; without the budget: 90 in one step


def test_proposals_take_what_the_decodes_and_due_prompts_leave_oldest_first() -> None:
    s = make_scheduler(budget=100, max_num_batched_tokens=12)
    a, b = decoding(s, 5, 5)
    a.spec.draft_ids, b.spec.draft_ids = [7] * 6, [7] * 6
    out = s.schedule()
    assert (len(a.spec.draft_ids), len(b.spec.draft_ids)) == (6, 4) and out.num_decode_tokens == 12
    run(s, out)
    s.add(make_seq("new", 5))  # a prompt is due: proposals never starve it
    a.spec.draft_ids, b.spec.draft_ids = [7] * 6, [7] * 6
    out = s.schedule()
    assert (len(a.spec.draft_ids), len(b.spec.draft_ids)) == (5, 0) and chunks(out) == [("new", 0, 5)]
    assert out.num_decode_tokens + sum(c.num_tokens for c in out.prefills) == 12


def test_without_a_budget_proposals_and_prompts_are_bounded_by_their_own_limits() -> None:
    s = make_scheduler(budget=100)
    a, = decoding(s, 5)
    a.spec.draft_ids = [7] * 6
    s.add(make_seq("long", 90))
    out = s.schedule()
    assert len(a.spec.draft_ids) == 6 and chunks(out) == [("long", 0, 90)]


def test_a_budget_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("max_num_batched_tokens (4) must be >= max_num_seqs (8)")):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)
