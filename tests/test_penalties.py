"""Tests for worker/engine/penalties.py: kept penalty counts equal the per-step histogram, and a
step adds only its new tokens."""

from __future__ import annotations

import random

import pytest
import torch

from protos.params import SamplingParams
from worker.engine.penalties import PenaltyCounts
from worker.engine.sampling import Sampler, SamplingRow, _token_counts, build_sampling_batch
from worker.engine.sequence import Sequence
from worker.engine.stopping import StoppingCriteria

VOCAB = 37
PENALTY = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
NONE = SamplingParams(temperature=0.7)


def make_seq(request_id: str, rng: random.Random, params: SamplingParams = PENALTY) -> Sequence:
    # ids up to VOCAB + 3: out-of-range ids must be ignored as the histogram ignores them
    prompt = [rng.randrange(-1, VOCAB + 3) for _ in range(rng.randrange(1, 30))]
    stopping = StoppingCriteria(params, frozenset(), 10_000)
    return Sequence(request_id, prompt, params, seed=7, stopping=stopping)


def rows_of(seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
    """The runner's rows for a sequence verifying `drafts` (none: one plain row)."""
    return [SamplingRow(seq.params, seq.seed, seq.prompt_ids, seq.output_ids + drafts[:j], owner=seq,
                        num_accepted=len(seq.output_ids)) for j in range(1 + len(drafts))]


def expected(rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """The histogram of each row with a penalty; zeros for the others (they share the zero row)."""
    def counted(ids: list[int], row: SamplingRow) -> list[int]:
        return ids if row.params != NONE else []
    return (_token_counts([counted(list(r.output_token_ids), r) for r in rows], VOCAB, "cpu"),
            _token_counts([counted(list(r.prompt_token_ids), r) for r in rows], VOCAB, "cpu") > 0)


@pytest.mark.parametrize("seed", range(6))
def test_kept_counts_equal_the_histogram_through_joins_growth_proposals_and_leaves(seed: int) -> None:
    """Random steps: requests with and without penalties join, accept 0-3 tokens, verify
    proposals, skip steps, leave and come back under the same id as a new request (a resume: a
    new owner, a new output): every row's counts and prompt mask equal the histogram of its
    lists (zeros without a penalty)."""
    rng = random.Random(seed)
    kept = PenaltyCounts(VOCAB, "cpu", capacity=1)
    live: dict[str, Sequence] = {}
    for _ in range(80):
        if len(live) < 6 and rng.random() < 0.4:
            rid = f"r{rng.randrange(8)}"
            live[rid] = make_seq(rid, rng, rng.choice([PENALTY, NONE]))
        if live and rng.random() < 0.15:
            live.pop(rng.choice(sorted(live)))
        for seq in live.values():
            seq.output_ids += [rng.randrange(VOCAB + 2) for _ in range(rng.randrange(4))]
        stepping = [s for s in live.values() if rng.random() < 0.8]
        proposals = {s.request_id: [rng.randrange(VOCAB) for _ in range(rng.randrange(3))] for s in stepping}
        rows = [row for s in stepping for row in rows_of(s, proposals[s.request_id])]
        if rows:
            counts, prompt = kept.gather(rows, repetition=True)
            want_counts, want_prompt = expected(rows)
            assert torch.equal(counts, want_counts)
            assert prompt is not None and torch.equal(prompt, want_prompt)
        kept.retain(live)
        assert kept.num_rows <= len(live)


def test_a_step_adds_only_its_new_tokens() -> None:
    """Work per step is the tokens accepted since the last step, not the whole output: after 200
    steps of one token each, the kept rows counted prompt + 200 ids, where rebuilding would
    have counted ~20,000."""
    rng = random.Random(0)
    kept = PenaltyCounts(VOCAB, "cpu")
    seq = make_seq("a", rng)
    prompt_ids = sum(0 <= t < VOCAB for t in seq.prompt_ids)
    for _ in range(200):
        seq.output_ids.append(rng.randrange(VOCAB))
        kept.gather(rows_of(seq, [1, 2]), repetition=True)
    assert kept.num_counted_tokens == prompt_ids + 200


def test_requests_without_a_penalty_hold_no_row() -> None:
    kept = PenaltyCounts(VOCAB, "cpu", capacity=1)
    rng = random.Random(3)
    plain = [make_seq(f"p{i}", rng, NONE) for i in range(5)]
    for seq in plain:
        seq.output_ids = [1, 2, 3]
    counts, _ = kept.gather([row for s in plain for row in rows_of(s, [4])], repetition=False)
    assert kept.num_rows == 0 and kept.num_counted_tokens == 0 and not counts.any()
    assert kept.counts.shape[0] == 2  # the zero row and the one of its capacity: nothing grew


def test_proposals_never_reach_the_kept_state() -> None:
    """A rejected proposal needs no rollback: the kept row counts accepted tokens only."""
    kept = PenaltyCounts(VOCAB, "cpu")
    seq = make_seq("a", random.Random(1))
    seq.output_ids = [3, 3]
    counts, _ = kept.gather(rows_of(seq, [5, 5]), repetition=False)
    assert counts[:, 5].tolist() == [0, 1, 2]
    seq.output_ids.append(4)  # the target rejected both 5s
    counts, prompt = kept.gather(rows_of(seq, []), repetition=False)
    assert prompt is None
    assert counts[0, 5].item() == 0 and counts[0, 3].item() == 2 and counts[0, 4].item() == 1


def test_a_sampler_with_kept_counts_draws_what_the_fresh_batch_draws() -> None:
    """Through the Sampler: the same tokens as a batch counted afresh, over many steps."""
    rng = random.Random(2)
    seqs = [make_seq(f"r{i}", rng, params) for i, params in enumerate(
        [PENALTY, SamplingParams(temperature=0.0, frequency_penalty=1.5), SamplingParams(temperature=1.0)])]
    sampler = Sampler(kept=PenaltyCounts(VOCAB, "cpu"))
    for step in range(40):
        rows = [row for s in seqs for row in rows_of(s, [rng.randrange(VOCAB)] if step % 3 == 0 else [])]
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step))
        got = sampler.sample(logits, rows, "cpu").token_ids
        want = Sampler()(logits, build_sampling_batch(rows, VOCAB, "cpu")).token_ids
        assert torch.equal(got, want)
        i = 0
        for s in seqs:  # each accepts the token of its first row
            s.output_ids.append(int(got[i]))
            i += len([r for r in rows if r.owner is s])


def test_bytes_per_request_is_what_a_kept_row_takes() -> None:
    """What the CUDA memory plan reserves per request (max_num_seqs + 1 rows) is a row's size."""
    kept = PenaltyCounts(VOCAB, "cpu", capacity=3)
    rows = kept.counts.shape[0]
    assert rows == 4 and kept.prompt.shape[0] == rows
    assert kept.counts.nbytes + kept.prompt.nbytes == rows * PenaltyCounts.bytes_per_request(VOCAB)
