"""Static decode steps (worker/model/static_decode.py), eagerly on CPU: a step padded to its bucket
in buffers allocated once gives exactly what the dynamic step gives, for every bucket; padding
rows write only the scratch block; an engine with static steps answers as one without."""

from __future__ import annotations

import random

import pytest
import torch

from tests.factories import greedy, make_engine, make_hf_model, make_prompts, ours_from_hf, run_to_completion
from worker.engine.config import EngineConfig
from worker.engine.input_batch import BatchBuilder
from worker.engine.sampling import SamplingParams
from worker.factory import use_cuda_graphs
from worker.model.llama import LlamaModel
from worker.model.static_decode import StaticDecode, decode_buckets

BLOCK = 4
MAX_LEN = 48
MAX_ROWS = 8


@pytest.fixture(scope="module", params=["q8_0-fused", "float-torch"])
def model(request: pytest.FixtureRequest) -> LlamaModel:
    """The fused C layers over Q8_0 (the cpu backend: batch-invariant, so exact) and float weights
    on the torch backend (its static path is another order of the same sums: close)."""
    hf = make_hf_model(max_position_embeddings=MAX_LEN)
    if request.param == "q8_0-fused":
        return ours_from_hf(hf, quantize_to="q8_0")
    return ours_from_hf(hf, native=False)


def random_rows(rng: random.Random, n: int, num_blocks: int) -> BatchBuilder:
    """Decode sequences of 1 to 3 tokens (a last token and the proposals it verifies), n tokens in
    all, of random lengths over distinct random blocks of the pool."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    rows = BatchBuilder(BLOCK, torch.device("cpu"))
    while len(rows.ids) < n:
        k = rng.randint(1, min(3, n - len(rows.ids)))
        length = rng.randint(k, MAX_LEN)
        table = [free.pop() for _ in range(-(-length // BLOCK))]
        rows.add(table, [rng.randrange(64) for _ in range(k)], length - k, k)
    return rows


def test_the_buckets_are_powers_of_two_up_to_the_most_rows() -> None:
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(12) == (1, 2, 4, 8, 12)
    assert decode_buckets(1) == (1,)


def test_a_padded_static_step_equals_the_dynamic_step_for_every_bucket(model: LlamaModel) -> None:
    num_blocks = MAX_ROWS * MAX_LEN // BLOCK
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    cache = model.new_cache(num_blocks + 1, BLOCK)  # + the scratch block
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    static = StaticDecode(model, cache, MAX_ROWS, -(-MAX_LEN // BLOCK), capture=False)
    is_exact = model.attention.name == "cpu"
    for n in range(1, MAX_ROWS + 1):  # rows; buckets 1, 2, 4, 8: each exactly, and padded from below
        rows = random_rows(rng, n, num_blocks)
        before = cache.k.clone()
        want = model.forward(rows.build(num_prefills=0), cache)  # (n, V), writes the rows' K/V
        cache.k.copy_(before)
        got = static.run(rows.ids, rows.positions, rows.slots, rows.row_tables())
        assert got.shape == want.shape
        if is_exact:
            assert torch.equal(got, want), f"{n} rows in bucket {static.bucket(n)}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the padding rows wrote the scratch block only: the pool holds what the dynamic step left
        after_dynamic = before.clone()
        for slot in rows.slots:
            after_dynamic[:, :, slot // BLOCK, slot % BLOCK] = cache.k[:, :, slot // BLOCK, slot % BLOCK]
        assert torch.equal(cache.k[:, :, :num_blocks], after_dynamic[:, :, :num_blocks])


def test_static_steps_refuse_what_they_cannot_run(model: LlamaModel) -> None:
    cache = model.new_cache(4, BLOCK)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StaticDecode(model, cache, 2, 2, capture=True)


@pytest.mark.parametrize("num_speculative_tokens", [0, 3])
def test_an_engine_with_static_decode_steps_answers_as_one_without(num_speculative_tokens: int) -> None:
    """Greedy and seeded sampling, with and without n-gram speculation (verify rows are decode
    rows too): the same tokens for every request."""
    model = ours_from_hf(make_hf_model(max_position_embeddings=MAX_LEN * 2), quantize_to="q8_0")
    prompts = make_prompts(6, lengths=(3, 9, 17, 5))
    outputs = []
    for static in (False, True):
        engine = make_engine(model, num_seqs=6, max_len=MAX_LEN * 2, static_decode=static,
                             num_speculative_tokens=num_speculative_tokens)
        assert (engine.runner.static is not None) == static
        for i, prompt in enumerate(prompts):
            params = (greedy(max_tokens=20) if i % 2 else
                      SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True))
            engine.add_request(f"r{i}", prompt, params, seed=i)
        outputs.append(run_to_completion(engine))
        if engine.runner.static is not None:
            assert engine.runner.static.num_steps > 10  # most steps were decode-only
    assert outputs[0] == outputs[1]


def test_cuda_graphs_default_to_cuda_only_and_cannot_be_asked_for_on_cpu(model: LlamaModel) -> None:
    assert use_cuda_graphs(EngineConfig(), model) is False  # CPU: static steps only in tests
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        EngineConfig(cuda_graphs=True)
