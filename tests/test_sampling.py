"""Tests for worker/engine/sampling.py: filters with hand-computed tables, determinism, statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from protos.params import SamplingParams
from worker.engine.sampling import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
    build_sampling_batch,
    counter_based_uniform,
    logits_to_probs,
)

VOCAB = 16
PROBS_4 = [0.5, 0.3, 0.15, 0.05]  # a hand-checkable distribution


def make_batch(
    params: Sequence[SamplingParams],
    vocab_size: int = VOCAB,
    seeds: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    """One SamplingRow per params. Without `outputs`, row i has `steps[i]` output tokens (a range:
    only its length is read unless a penalty is on)."""
    n = len(params)
    seeds = seeds if seeds is not None else [1234 + i for i in range(n)]
    steps = steps if steps is not None else [0] * n
    outputs = outputs if outputs is not None else [range(s) for s in steps]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    rows = [SamplingRow(p, s, pr, out) for p, s, pr, out in zip(params, seeds, prompts, outputs, strict=True)]
    return build_sampling_batch(rows, vocab_size, "cpu")


def logits_of(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])  # (V,)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def kept_probs(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > 0).flatten().tolist())


@pytest.mark.parametrize(
    "logits",
    [[0.1, 2.0, -1.0, 1.9], [5.0, -5.0, 0.0, 4.99], [-3.0, -2.0, -1.0, -0.5], [0.0, 0.0, 7.0, float("-inf")]],
)
@pytest.mark.parametrize("seed", [0, 7, 2**63 - 1])
def test_greedy_is_argmax_whatever_the_seed(logits: list[float], seed: int) -> None:
    batch = make_batch([SamplingParams(temperature=0.0)], vocab_size=4, seeds=[seed], steps=[3])
    out = Sampler()(torch.tensor([logits]), batch)
    assert out.token_ids.tolist() == [max(range(4), key=lambda i: logits[i])]
    assert out.logprobs is None and out.top_ids is None


def test_temperature_to_zero_limit_is_argmax() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)).repeat(64, 1)  # (64, 100)
    batch = make_batch([SamplingParams(temperature=1e-4)] * 64, vocab_size=100, seeds=range(64))
    assert set(Sampler()(logits, batch).token_ids.tolist()) == {int(logits[0].argmax())}


@pytest.mark.parametrize(
    ("logits", "k", "expected"),
    [
        ([1.0, 4.0, 3.0, 2.0], 1, {1}),
        ([1.0, 4.0, 3.0, 2.0], 2, {1, 2}),
        ([1.0, 4.0, 3.0, 2.0], 3, {1, 2, 3}),
        ([1.0, 4.0, 3.0, 2.0], 0, {0, 1, 2, 3}),  # 0 = off
        ([1.0, 4.0, 3.0, 2.0], 9, {0, 1, 2, 3}),  # k > V keeps all
    ],
)
def test_top_k_keeps_the_k_largest(logits: list[float], k: int, expected: set[int]) -> None:
    batch = make_batch([SamplingParams(top_k=k), SamplingParams(top_k=2)], vocab_size=4)
    filtered = apply_top_k_top_p(torch.tensor([logits, logits]), batch)  # (2, 4); row 1 forces the work
    assert kept(filtered[0]) == expected
    assert filtered[0, sorted(expected)].tolist() == [logits[i] for i in sorted(expected)]


@pytest.mark.parametrize("top_p", [1.0, 0.99])  # top-k alone (topk), and with top-p (one sort)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_top_k_keeps_every_logit_tied_with_the_kth(k: int, top_p: float) -> None:
    """An exact tie has no order to break it by that a CPU sort and a CUDA sort would agree on:
    tokens tied with the k-th largest are all kept, so the result depends on the values alone."""
    logits = torch.tensor([[2.0, 5.0, 5.0, 5.0, 5.0, 1.0]])  # four-way tie at the top
    filtered = apply_top_k_top_p(logits, make_batch([SamplingParams(top_k=k, top_p=top_p)], vocab_size=6))
    assert kept(filtered[0]) == {1, 2, 3, 4}


def test_top_k_alone_equals_the_sorting_path_on_untied_rows() -> None:
    """topk of the batch's largest k and a threshold per row: rows with other k, off (0) or k >= V
    keep what the sort keeps."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g)  # (B, V), no ties
    params = [SamplingParams(top_k=k) for k in (1, 7, 0, 50, 99, 20)]
    filtered = apply_top_k_top_p(logits, make_batch(params, vocab_size=50))
    for row, k in enumerate((1, 7, 50, 50, 50, 20)):
        assert kept(filtered[row]) == set(logits[row].topk(k).indices.tolist()), row


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.3, {0}),  # the top token alone reaches 0.3
        (0.45, {0}),
        (0.7, {0, 1}),  # 0.5 < 0.7 <= 0.8
        (0.9, {0, 1, 2}),  # 0.8 < 0.9 <= 0.95
        (0.99, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),  # off
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    batch = make_batch([SamplingParams(top_p=top_p)], vocab_size=4)
    assert kept(apply_top_k_top_p(logits_of(PROBS_4)[None, :], batch)[0]) == expected


def test_top_k_then_top_p_on_the_renormalised_distribution() -> None:
    # top_k=3 renormalises [0.5, 0.3, 0.15] to [0.526, 0.316, 0.158]; top_p=0.83 then keeps 2 tokens
    # (mass before the 3rd is 0.842 >= 0.83), where on the full distribution (0.8 < 0.83) it would keep 3.
    batch = make_batch([SamplingParams(top_k=3, top_p=0.83)], vocab_size=4)
    assert kept(apply_top_k_top_p(logits_of(PROBS_4)[None, :], batch)[0]) == {0, 1}


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, {0, 1, 2, 3}), (0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.7, {0}), (1.0, {0})],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p: float, expected: set[int]) -> None:
    batch = make_batch([SamplingParams(min_p=min_p)], vocab_size=4)
    assert kept_probs(logits_to_probs(logits_of(PROBS_4)[None, :], batch)[0]) == expected


@pytest.mark.parametrize(
    ("params", "prompt", "output", "expected"),
    [
        # repetition 2: seen positives are halved, seen negatives doubled; prompt OR output counts as seen
        (SamplingParams(repetition_penalty=2.0), [0], [2], [1.0, -2.0, -6.0, 0.0, 4.0]),
        (SamplingParams(repetition_penalty=0.5), [0, 1, 3], [], [4.0, -1.0, -3.0, 0.0, 4.0]),
        # presence 0.5: once per distinct output token; the prompt does not count
        (SamplingParams(presence_penalty=0.5), [1], [0, 0, 4], [1.5, -2.0, -3.0, 0.0, 3.5]),
        # frequency 0.5: per occurrence in the output
        (SamplingParams(frequency_penalty=0.5), [1], [0, 0, 4], [1.0, -2.0, -3.0, 0.0, 3.5]),
        (SamplingParams(frequency_penalty=-1.0), [], [2, 2, 2], [2.0, -2.0, 0.0, 0.0, 4.0]),
        # all three: repetition first, then presence + frequency
        (
            SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.25),
            [1],
            [0, 0, 0, 2],
            [1.0 - 1.0 - 0.75, -4.0, -6.0 - 1.0 - 0.25, 0.0, 4.0],
        ),
    ],
)
def test_penalties_hand_computed(
    params: SamplingParams, prompt: list[int], output: list[int], expected: list[float]
) -> None:
    logits = torch.tensor([[2.0, -2.0, -3.0, 0.0, 4.0]])  # (1, 5)
    batch = make_batch([params], vocab_size=5, prompts=[prompt], outputs=[output], steps=[len(output)])
    assert apply_penalties(logits, batch)[0].tolist() == pytest.approx(expected)


def test_penalties_are_per_row_and_skipped_when_off() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])  # (2, 3)
    on_off = make_batch(
        [SamplingParams(repetition_penalty=2.0), SamplingParams()], 3, prompts=[[0], [0]], outputs=[[1], [1]]
    )
    assert apply_penalties(logits, on_off).tolist() == [[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]
    off = make_batch([SamplingParams()] * 2, 3, prompts=[[0], [0]], outputs=[[1], [1]])
    assert not off.enable_penalties and off.output_counts is None and off.prompt_mask is None
    assert apply_penalties(logits, off) is logits


def test_greedy_rows_take_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    batch = make_batch([SamplingParams(temperature=0.0, frequency_penalty=2.0)], 3, outputs=[[0]], steps=[1])
    assert Sampler()(logits, batch).token_ids.tolist() == [1]


def test_each_row_uses_its_own_params_in_a_mixed_batch() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.7),
        SamplingParams(top_k=2, temperature=0.5),
        SamplingParams(),
    ]
    logits = logits_of(PROBS_4)[[1, 0, 2, 3]].repeat(len(params), 1)  # (6, 4), argmax is token 1
    batch = make_batch(params, vocab_size=4)
    probs = logits_to_probs(logits, batch)  # (6, 4)
    assert [kept_probs(row) for row in probs[1:]] == [{1}, {1}, {1}, {0, 1}, {0, 1, 2, 3}]
    assert Sampler()(logits, batch).token_ids[:4].tolist() == [1, 1, 1, 1]
    for i, p in enumerate(params):  # each row alone gives the same probabilities and token
        alone = make_batch([p], vocab_size=4, seeds=[int(batch.seeds[i])])
        assert torch.equal(logits_to_probs(logits[i : i + 1], alone)[0], probs[i])
        assert Sampler()(logits[i : i + 1], alone).token_ids.item() == Sampler()(logits, batch).token_ids[i]


@pytest.mark.parametrize("step", [0, 1, 17, 2**31 + 5])
def test_same_seed_and_step_gives_the_same_token(step: int) -> None:
    logits = torch.zeros(8, 1000)  # (8, 1000) uniform: the token is decided by the noise alone
    batch = make_batch([SamplingParams(seed=5)] * 8, 1000, seeds=[5] * 8, steps=[step] * 8)
    assert len(set(Sampler()(logits, batch).token_ids.tolist())) == 1


def test_tokens_vary_with_step_and_with_seed() -> None:
    logits = torch.zeros(64, 1000)  # (64, 1000)
    by_step = make_batch([SamplingParams()] * 64, 1000, seeds=[5] * 64, steps=range(64))
    by_seed = make_batch([SamplingParams()] * 64, 1000, seeds=range(64), steps=[3] * 64)
    assert len(set(Sampler()(logits, by_step).token_ids.tolist())) > 50
    assert len(set(Sampler()(logits, by_seed).token_ids.tolist())) > 50


def test_seeds_above_2_63_are_their_own_streams() -> None:
    """The proto's seed is uint64: seeds past int64 keep their high bit (not wrapped onto another seed)."""
    logits = torch.zeros(64, 1000)  # (64, 1000)
    high = [2**63 + i for i in range(32)] + [2**64 - 1 - i for i in range(32)]
    low = [s - 2**63 for s in high]  # the same bits without the top one
    tokens = Sampler()(logits, make_batch([SamplingParams()] * 64, 1000, seeds=high, steps=[3] * 64))
    again = Sampler()(logits, make_batch([SamplingParams()] * 64, 1000, seeds=high, steps=[3] * 64))
    other = Sampler()(logits, make_batch([SamplingParams()] * 64, 1000, seeds=low, steps=[3] * 64))
    assert torch.equal(tokens.token_ids, again.token_ids)
    assert (tokens.token_ids != other.token_ids).sum() > 50


@pytest.mark.parametrize(("position", "batch_size"), [(0, 1), (0, 5), (3, 5), (6, 7)])
def test_token_and_noise_do_not_depend_on_batch_layout(position: int, batch_size: int) -> None:
    vocab = 200
    gen = torch.Generator().manual_seed(position * 31 + batch_size)
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(99))  # (V,)
    target = SamplingParams(top_p=0.9, temperature=0.8, seed=42)
    logits = torch.randn(batch_size, vocab, generator=gen) * 3  # (B, V) random neighbours
    logits[position] = target_logits
    params = [SamplingParams(top_k=1 + i, temperature=0.0 if i % 2 else 1.3) for i in range(batch_size)]
    params[position] = target
    seeds = [int(s) for s in torch.randint(0, 2**62, (batch_size,), generator=gen)]
    steps = [int(s) for s in torch.randint(0, 50, (batch_size,), generator=gen)]
    seeds[position], steps[position] = 42, 11
    batch = make_batch(params, vocab, seeds=seeds, steps=steps)

    reference = make_batch([target], vocab, seeds=[42], steps=[11])
    expected_token = Sampler()(target_logits[None, :], reference).token_ids.item()
    assert Sampler()(logits, batch).token_ids[position].item() == expected_token
    noise = counter_based_uniform(batch.seeds, batch.steps, vocab)  # (B, V)
    assert torch.equal(noise[position], counter_based_uniform(reference.seeds, reference.steps, vocab)[0])


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize(("seed", "step"), [(0, 0), (1, 0), (0, 1), (2**63 - 1, 2**40 + 3), (987654321, 12)])
def test_noise_is_the_documented_hash_of_seed_step_and_token(seed: int, step: int) -> None:
    """The noise is a pure function, so a CPU, GPU or other implementation must agree bit for bit."""
    step_key = _lowbias32((step & 0xFFFFFFFF) ^ 0x9E3779B9)
    row = _lowbias32((seed & 0xFFFFFFFF) ^ _lowbias32((seed >> 32) ^ 0x85EBCA6B ^ step_key))
    expected = [((_lowbias32(row ^ _lowbias32(v ^ 0xC2B2AE35)) >> 9) + 0.5) / 2**23 for v in range(40)]
    noise = counter_based_uniform(torch.tensor([seed]), torch.tensor([step]), 40)[0]  # (40,)
    assert noise.tolist() == expected


def test_noise_is_uniform_in_the_open_unit_interval() -> None:
    noise = counter_based_uniform(torch.arange(32), torch.arange(32) * 3, 1000)  # (32, 1000)
    assert 0.0 < noise.min().item() and noise.max().item() < 1.0
    assert noise.mean().item() == pytest.approx(0.5, abs=0.005)
    histogram = torch.histc(noise, bins=10, min=0.0, max=1.0)
    assert ((histogram - 3200).abs() < 300).all()


@pytest.mark.parametrize(
    ("params", "vary"),
    [
        (SamplingParams(), "seed"),
        (SamplingParams(), "step"),
        (SamplingParams(temperature=0.7), "seed"),
        (SamplingParams(top_k=5), "seed"),
        (SamplingParams(top_p=0.8), "step"),
    ],
)
def test_empirical_distribution_matches_the_filtered_softmax(params: SamplingParams, vary: str) -> None:
    num_draws, vocab = 20_000, 10
    logits = torch.linspace(-2.0, 1.5, vocab)  # (V,)
    index = list(range(num_draws))
    seeds, steps = (index, [0] * num_draws) if vary == "seed" else ([77] * num_draws, index)
    batch = make_batch([params] * num_draws, vocab, seeds=seeds, steps=steps)
    expected = logits_to_probs(logits[None, :], make_batch([params], vocab))[0]  # (V,)
    expected = expected / expected.sum()
    counts = torch.bincount(Sampler()(logits.repeat(num_draws, 1), batch).token_ids, minlength=vocab)
    assert counts[expected == 0].sum() == 0
    observed, want = counts[expected > 0].double(), expected[expected > 0].double() * num_draws
    chi_square = ((observed - want) ** 2 / want).sum().item()
    assert chi_square < 40.0  # < 9 degrees of freedom: p ~ 1e-5 for a correct sampler


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_row_fails_alone(bad: float) -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))  # (4, V)
    logits[2, 7] = bad
    logits[3, :40] = float("-inf")  # masked tokens are fine: still sampleable
    params = [
        SamplingParams(top_logprobs=2),
        SamplingParams(top_logprobs=2, temperature=0.0),
        SamplingParams(top_logprobs=2, top_p=0.5),
        SamplingParams(top_logprobs=2, top_k=3),
    ]
    out = Sampler()(logits, make_batch(params, vocab))
    assert out.is_finite.tolist() == [True, True, False, True]
    clean = [0, 1, 3]
    alone = Sampler()(logits[clean], make_batch([params[i] for i in clean], vocab, seeds=[1234, 1235, 1237]))
    assert out.token_ids[clean].tolist() == alone.token_ids.tolist()
    assert out.token_ids[3].item() >= 40
    assert out.logprobs is not None and out.top_logprobs is not None
    assert torch.isfinite(out.logprobs[clean]).all() and torch.isfinite(out.top_logprobs[clean]).all()


def test_all_minus_inf_row_is_not_finite() -> None:
    logits = torch.zeros(2, 8)
    logits[1] = float("-inf")
    assert Sampler()(logits, make_batch([SamplingParams()] * 2, 8)).is_finite.tolist() == [True, False]


def test_logprobs_are_raw_log_softmax() -> None:
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * 2  # (3, V)
    params = [
        SamplingParams(logprobs=True, temperature=0.3, repetition_penalty=1.5),
        SamplingParams(top_logprobs=4, top_k=3),
        SamplingParams(),  # did not ask: gets values anyway, the caller drops them
    ]
    batch = make_batch(params, vocab, prompts=[[0, 1], [2], []])
    out = Sampler()(logits.to(torch.bfloat16), batch)
    raw = logits.to(torch.bfloat16).float().log_softmax(-1)  # (3, V)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])
    assert out.top_ids.shape == (3, 4)
    torch.testing.assert_close(out.top_logprobs, raw.topk(4, dim=-1).values)
    assert out.top_ids.tolist() == raw.topk(4, dim=-1).indices.tolist()


@pytest.mark.parametrize(
    ("params", "expected_k"),
    [([SamplingParams()], None), ([SamplingParams(logprobs=True)], 0), ([SamplingParams(top_logprobs=3)], 3)],
)
def test_logprob_outputs_follow_the_request(params: list[SamplingParams], expected_k: int | None) -> None:
    out = Sampler()(torch.zeros(1, 10), make_batch(params, 10))
    assert (out.logprobs is None) == (expected_k is None)
    assert (None if out.top_ids is None else out.top_ids.shape[1]) == (expected_k or None)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's, from the compiler's imports
def test_the_fused_race_draws_exactly_the_eager_races_tokens() -> None:
    """CUDA's sampler compiles the noise, the division and the argmax into one kernel
    (fused_exponential_race); here it compiles for the CPU (~30 s, once) and must draw the eager
    race's tokens for every row, at batch sizes it was not compiled for too (dynamic shapes),
    seeds of all 64 bits included."""
    fused, eager = Sampler(fused=True), Sampler()
    assert fused.race is not eager.race
    gen = torch.Generator().manual_seed(0)
    for rows in (5, 1, 37):
        logits = torch.randn(rows, 1000, generator=gen) * 3  # (B, V)
        params = [SamplingParams(temperature=0.5 + i % 3, top_k=(0, 20, 0)[i % 3],
                                 min_p=(0.0, 0.0, 0.05)[i % 3]) for i in range(rows)]
        seeds = [int(torch.randint(0, 2**62, (1,), generator=gen)) * (1 + i % 3) for i in range(rows)]
        batch = make_batch(params, 1000, seeds=seeds, steps=[i * 7 for i in range(rows)])
        assert torch.equal(fused(logits, batch).token_ids, eager(logits, batch).token_ids), rows
