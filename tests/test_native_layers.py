"""kernels/layer.c: a decode step's layers in one C call give exactly what the per-op path gives."""

from __future__ import annotations

import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.factories import forward_in_chunks, kernels_built_with, make_hf_model, ours_from_hf
from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.model.native import COMPILERS, load_native_kernels
from worker.model.native_quant import ISA_ENV

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: the model uses its torch path", allow_module_level=True)

BLOCK = 4


@dataclass
class Step:
    batch: ForwardBatch
    cache: KVCache


def make_step(model: LlamaModel, lengths: list[int], kv_dtype: torch.dtype, seed: int = 0) -> Step:
    """A decode step over rows with `lengths` cached positions (random K/V in scattered blocks,
    the new token's slot at position length)."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-(n + 1) // BLOCK) for n in lengths]
    num_blocks = sum(per_row) + 3
    cache = KVCache(model.config, num_blocks, BLOCK, kv_dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lengths), max(per_row), dtype=torch.int32)  # (B, M), padded with block 0
    used = 0
    for b, m in enumerate(per_row):
        tables[b, :m] = order[used:used + m]
        used += m
    pos = torch.tensor(lengths)  # (B,): the new token's position
    slots = tables[torch.arange(len(lengths)), pos // BLOCK].long() * BLOCK + pos % BLOCK
    lens = tuple(n + 1 for n in lengths)
    batch = ForwardBatch(
        input_ids=torch.randint(0, model.config.vocab_size, (len(lengths),), generator=g), positions=pos,
        slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=tuple(range(len(lengths) + 1)), context_lens_host=lens, num_prefills=0,
        logits_indices=torch.arange(len(lengths)))
    return Step(batch, cache)


def run(model: LlamaModel, step: Step, fused: bool) -> tuple[torch.Tensor, KVCache]:
    cache = KVCache(model.config, step.cache.num_blocks, BLOCK, step.cache.dtype, torch.device("cpu"))
    cache.k.copy_(step.cache.k)
    cache.v.copy_(step.cache.v)
    layers, model.decode_layers = model.decode_layers, (model.decode_layers if fused else None)
    try:
        return model.forward(step.batch, cache), cache
    finally:
        model.decode_layers = layers


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def model(request: pytest.FixtureRequest) -> LlamaModel:
    hf = make_hf_model(num_heads=4, num_kv_heads=2, attention_bias=True)
    m = ours_from_hf(hf, quantize_to=request.param)
    assert m.decode_layers is not None, "every weight is quantized: the fused path must be on"
    return m


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[0], [5, 0, 13, 31, 2, 8]])
def test_fused_layers_equal_the_per_op_path_bit_for_bit(model: LlamaModel, kv_dtype: torch.dtype,
                                                        lengths: list[int]) -> None:
    step = make_step(model, lengths, kv_dtype)
    fused_logits, fused_cache = run(model, step, fused=True)
    logits, cache = run(model, step, fused=False)
    assert torch.equal(fused_cache.k, cache.k) and torch.equal(fused_cache.v, cache.v)  # K/V written alike
    assert torch.equal(fused_logits, logits)
    assert not torch.equal(fused_cache.k, step.cache.k)  # and something was written


def test_every_instruction_set_gives_the_same_step(model: LlamaModel) -> None:
    kernels = load_native_kernels()
    assert kernels is not None and model.decode_layers is not None
    step = make_step(model, [3, 17, 9], torch.float32)
    outs = {}
    for isa in kernels.quant.supported_isas:
        cache = KVCache(model.config, step.cache.num_blocks, BLOCK, torch.float32, torch.device("cpu"))
        cache.k.copy_(step.cache.k)
        cache.v.copy_(step.cache.v)
        x = model._embed(step.batch.input_ids)
        b = step.batch
        model.decode_layers(x, b.positions, b.slot_mapping, b.block_tables, b.context_lens, cache.k, cache.v,
                            isa=isa)
        outs[isa] = x
    for isa, x in outs.items():  # the same floats in the same order on every path (quant.c)
        assert torch.equal(x, outs["scalar"]), f"{isa} vs scalar"


@pytest.mark.parametrize("breakage, message", [
    ("lens", "context length"), ("block", "block id"), ("position", "position"), ("slot", "slot")])
def test_bad_step_metadata_is_refused_before_anything_is_written(model: LlamaModel, breakage: str,
                                                                 message: str) -> None:
    step = make_step(model, [5, 9], torch.float32)
    b = step.batch
    if breakage == "lens":
        b.context_lens[1] = b.block_tables.shape[1] * BLOCK + 1
    elif breakage == "block":
        b.block_tables[0, 0] = step.cache.num_blocks
    elif breakage == "position":
        b.positions[0] = model.cos.shape[0]
    else:
        b.slot_mapping[1] = step.cache.num_blocks * BLOCK
    k, v = step.cache.k.clone(), step.cache.v.clone()
    assert model.decode_layers is not None
    with pytest.raises(ValueError, match=message):
        model.decode_layers(model._embed(b.input_ids), b.positions, b.slot_mapping, b.block_tables,
                            b.context_lens, step.cache.k, step.cache.v)
    assert torch.equal(step.cache.k, k) and torch.equal(step.cache.v, v)


def test_a_float_model_runs_per_op() -> None:
    assert ours_from_hf(make_hf_model()).decode_layers is None


def test_a_prompt_chunk_computes_what_its_tokens_decoded_one_by_one_compute(model: LlamaModel) -> None:
    """Every token is a decode row of the fused layers, so chunking or batching changes no bit:
    what lets a preempted or resumed request recompute exactly the K/V and logits it had."""
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(5))
    n, blocks = ids.shape[0], -(-ids.shape[0] // BLOCK)
    tables = torch.tensor([[2, 0, 1][:blocks]], dtype=torch.int32)  # scattered blocks

    def batch(a: int, b: int) -> ForwardBatch:
        pos = torch.arange(a, b)
        slots = tables[0, pos // BLOCK].long() * BLOCK + pos % BLOCK
        return ForwardBatch(input_ids=ids[a:b], positions=pos, slot_mapping=slots, block_tables=tables,
                            context_lens=torch.tensor([b], dtype=torch.int32), query_start_loc=(0, b - a),
                            context_lens_host=(b,), num_prefills=1 if a == 0 else 0,
                            logits_indices=torch.arange(b - a))

    whole = KVCache(model.config, 3, BLOCK, torch.float32, torch.device("cpu"))
    one_by_one = KVCache(model.config, 3, BLOCK, torch.float32, torch.device("cpu"))
    chunk_logits = model.forward(batch(0, n), whole)  # (n, V)
    step_logits = torch.cat([model.forward(batch(i, i + 1), one_by_one) for i in range(n)])
    assert torch.equal(chunk_logits, step_logits)
    assert torch.equal(whole.k, one_by_one.k) and torch.equal(whole.v, one_by_one.v)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_2048_token_prompt_gives_the_same_bits_in_any_chunking(kind: str) -> None:
    """Issue 25's proof for prompt chunks of 1 to 2,048 tokens: whatever tiles and row groups
    the kernels pick for a chunk's rows, every token's logits and K/V are the same bits."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2, max_position_embeddings=2048)
    m = ours_from_hf(hf, quantize_to=kind)
    ids = torch.randint(0, m.config.vocab_size, (2048,), generator=torch.Generator().manual_seed(7))
    whole, whole_cache = forward_in_chunks(m, ids, [2048])
    for sizes in ([1, 7, 64, 500, 3, 1000], [9] * 40 + [2048], [513, 1, 1534]):
        logits, cache = forward_in_chunks(m, ids, sizes)
        assert torch.equal(logits, whole), f"chunks {sizes[:6]}"
        assert torch.equal(cache.k, whole_cache.k) and torch.equal(cache.v, whole_cache.v)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_an_avx2_host_computes_this_hosts_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float of the quantized forward has one order on every x86 host with FMA: the linears'
    whole-block sums (kernels/quant.c), attention's per-key chains and fixed-order softmax and
    RMSNorm sums (kernels/attention.h). So a build for an AVX2-only CPU, on its AVX2 kernels,
    gives this host's logits and K/V bit for bit, prompt chunks (AMX here where the CPU has it)
    and decodes alike: a request resumed on another kind of worker goes on with the same tokens."""
    monkeypatch.setenv(ISA_ENV, "avx2")
    avx2 = kernels_built_with("-mno-avx512f", tmp_path, monkeypatch)
    monkeypatch.delenv(ISA_ENV)
    assert avx2.quant.isa == "avx2"
    hf = make_hf_model(num_heads=1, num_kv_heads=1, max_position_embeddings=512)  # head dim 64: the SIMD path
    here, there = ours_from_hf(hf, quantize_to="q4_0"), ours_from_hf(hf, quantize_to="q4_0", kernels=avx2)
    ids = torch.randint(0, here.config.vocab_size, (300,), generator=torch.Generator().manual_seed(3))
    for sizes in ([300], [64, 1]):
        (logits, cache), (logits_avx2, cache_avx2) = (forward_in_chunks(m, ids, sizes) for m in (here, there))
        assert torch.equal(logits, logits_avx2), sizes
        assert torch.equal(cache.k, cache_avx2.k) and torch.equal(cache.v, cache_avx2.v)
