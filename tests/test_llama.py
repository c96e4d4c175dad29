"""Logits parity of worker/model/llama.py with transformers' LlamaForCausalLM."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.factories import make_hf_model, ours_from_hf  # noqa: E402
from worker.model.llama import ForwardBatch, KVCache, LlamaModel  # noqa: E402
from worker.model.native import COMPILERS  # noqa: E402

TOL = 1e-4
HAS_COMPILER = any(shutil.which(c) for c in COMPILERS)  # else CPU decode falls back to torch


def run_prefill(model: LlamaModel, cache: KVCache, ids: list[int], slot: int) -> torch.Tensor:
    t = len(ids)
    batch = ForwardBatch(
        input_ids=torch.tensor([ids]), positions=torch.arange(t)[None], slot_ids=torch.tensor([slot]),
        kv_len=t, slot_range=slice(slot, slot + 1), segment_bounds=(0, t),
    )
    return model.forward(batch, cache)[0]


CASES = {
    "gqa_untied": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie=True),
    "mqa": dict(num_heads=4, num_kv_heads=1),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "linear_rope_bias": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True),
}


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_every_decode_step_match_transformers(case: str, native: bool) -> None:
    hf = make_hf_model(**CASES[case])  # type: ignore[arg-type]
    ours = ours_from_hf(hf, native=native)
    assert (ours.native_decode is not None) == (native and HAS_COMPILER)
    cache = KVCache(ours.config, num_slots=3, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 40), generator=g)[0].tolist()
    prompt, rest = ids[:24], ids[24:]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # (T, V)
    got = run_prefill(ours, cache, prompt, slot=1)
    assert (got - ref[len(prompt) - 1]).abs().max() <= TOL
    for j, tok in enumerate(rest[:-1]):
        pos = len(prompt) + j
        batch = ForwardBatch(input_ids=torch.tensor([[tok]]), positions=torch.tensor([[pos]]),
                             slot_ids=torch.tensor([1]), kv_len=pos + 1, slot_range=slice(1, 2))
        step_logits = ours.forward(batch, cache)[0]
        assert (step_logits - ref[pos]).abs().max() <= TOL, f"decode step {j}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_path_tracks_transformers_fp32(dtype: torch.dtype) -> None:
    """What CUDA runs (F.linear on plain weights, a half-precision KV cache), checked on CPU."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2)
    ours = ours_from_hf(hf, dtype=dtype)
    assert ours.layers[0].wqkv.dtype == dtype and ours.layers[0].wqkv.layout == torch.strided  # not packed
    cache = KVCache(ours.config, num_slots=2, max_len=64, dtype=dtype, device=torch.device("cpu"))
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))[0].tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # (T, V) fp32
    scale = ref.abs().max().item()
    got = run_prefill(ours, cache, ids[:24], slot=0)
    assert got.dtype == torch.float32
    assert (got - ref[23]).abs().max() <= 0.01 * scale
    for pos in range(24, 31):
        batch = ForwardBatch(input_ids=torch.tensor([[ids[pos]]]), positions=torch.tensor([[pos]]),
                             slot_ids=torch.tensor([0]), kv_len=pos + 1, slot_range=slice(0, 1))
        assert (ours.forward(batch, cache)[0] - ref[pos]).abs().max() <= 0.01 * scale, f"position {pos}"


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_packed_prefill_of_several_prompts_matches_each_alone(native: bool) -> None:
    hf = make_hf_model()
    ours = ours_from_hf(hf, native=native)
    cache = KVCache(ours.config, num_slots=4, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 1, 13)]
    slots = [2, 0, 3]
    lengths = [len(p) for p in prompts]
    batch = ForwardBatch(
        input_ids=torch.tensor([[t for p in prompts for t in p]]),
        positions=torch.cat([torch.arange(n) for n in lengths])[None],
        slot_ids=torch.tensor([slots[0]]), kv_len=max(lengths),
        segment_bounds=(0, *itertools.accumulate(lengths)),
        token_slots=torch.tensor([s for s, n in zip(slots, lengths, strict=True) for _ in range(n)])[None],
    )
    got = ours.forward(batch, cache)  # (3, V)
    for p, row in zip(prompts, got, strict=True):
        with torch.no_grad():
            assert (row - hf(torch.tensor([p])).logits[0, -1]).abs().max() <= TOL
    # the cache now holds each prompt in its own slot: a decode step continues each correctly
    nxt = [int(r.argmax()) for r in got]
    step = ForwardBatch(input_ids=torch.tensor(nxt)[:, None], positions=torch.tensor(lengths)[:, None],
                        slot_ids=torch.tensor(slots), kv_len=max(lengths) + 1)
    for p, tok, row in zip(prompts, nxt, ours.forward(step, cache), strict=True):
        with torch.no_grad():
            assert (row - hf(torch.tensor([p + [tok]])).logits[0, -1]).abs().max() <= TOL


def test_chunked_prefill_continues_from_the_cache() -> None:
    """A prompt computed in chunks (each attending to the cached keys of the ones before),
    packed next to a fresh prompt, gives the logits of one whole pass."""
    hf = make_hf_model()
    ours = ours_from_hf(hf)
    cache = KVCache(ours.config, num_slots=3, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    long = torch.randint(0, 128, (30,), generator=g).tolist()
    fresh = torch.randint(0, 128, (5,), generator=g).tolist()
    with torch.no_grad():
        ref_long, ref_fresh = hf(torch.tensor([long])).logits[0], hf(torch.tensor([fresh])).logits[0, -1]
    run_prefill(ours, cache, long[:11], slot=2)  # chunk 1: [0, 11)
    # chunk 2 of `long` ([11, 20), slot 2) and all of `fresh` (slot 0) in one packed pass
    ids = long[11:20] + fresh
    batch = ForwardBatch(
        input_ids=torch.tensor([ids]), positions=torch.cat([torch.arange(11, 20), torch.arange(5)])[None],
        slot_ids=torch.tensor([2]), kv_len=20, segment_bounds=(0, 9, 14),
        token_slots=torch.tensor([2] * 9 + [0] * 5)[None], segment_starts=(11, 0), segment_slots=(2, 0))
    got = ours.forward(batch, cache)  # (2, V)
    assert (got[0] - ref_long[19]).abs().max() <= TOL
    assert (got[1] - ref_fresh).abs().max() <= TOL
    last = ForwardBatch(input_ids=torch.tensor([long[20:]]), positions=torch.arange(20, 30)[None],
                        slot_ids=torch.tensor([2]), kv_len=30, segment_bounds=(0, 10),
                        token_slots=torch.full((1, 10), 2), segment_starts=(20,), segment_slots=(2,))
    assert (ours.forward(last, cache)[0] - ref_long[29]).abs().max() <= TOL


@pytest.mark.skipif(not HAS_COMPILER, reason="mixed steps need the native decode kernel (no C compiler here)")
def test_mixed_step_of_prompt_chunks_and_decodes_matches_transformers() -> None:
    """One packed row: a fresh prompt, the second chunk of another, then one decode token
    for each of two running sequences; every logit row equals transformers'."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2)
    ours = ours_from_hf(hf)
    cache = KVCache(ours.config, num_slots=4, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    running = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 19)]  # slots 3 and 1
    fresh, chunked = (torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 16))  # slots 0 and 2
    for ids, slot in zip(running, (3, 1), strict=True):
        run_prefill(ours, cache, ids[:-1], slot)  # their last token is this step's decode input
    run_prefill(ours, cache, chunked[:9], slot=2)  # chunk 1 of `chunked`
    ids = fresh + chunked[9:] + [r[-1] for r in running]
    positions = [*range(5), *range(9, 16), len(running[0]) - 1, len(running[1]) - 1]
    batch = ForwardBatch(
        input_ids=torch.tensor([ids]), positions=torch.tensor([positions]), slot_ids=torch.tensor([0]),
        kv_len=16, segment_bounds=(0, 5, 12), token_slots=torch.tensor([[0] * 5 + [2] * 7 + [3, 1]]),
        segment_starts=(0, 9), segment_slots=(0, 2), decode_slot_ids=torch.tensor([3, 1]))
    got = ours.forward(batch, cache)  # (2 prompts + 2 decodes, V)
    assert got.shape[0] == 4
    with torch.no_grad():
        for row, seq in zip(got, [fresh, chunked, *running], strict=True):
            assert (row - hf(torch.tensor([seq])).logits[0, -1]).abs().max() <= TOL
