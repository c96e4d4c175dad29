"""Block-quantized weights (worker/model/quant.py): GGUF blocks, dequantization, Linears, the
real SmolLM2 GGUF's load, and the factory's --quantization choices."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.quant_factories import (
    CPU,
    KINDS,
    NMSE_16BIT,
    NMSE_MAX,
    float_linear,
    make_inputs,
    make_weight,
    nmse,
    pack_blocks,
)
from worker.engine.config import EngineConfig
from worker.factory import build_model, quantize_to
from worker.model.linear import Linears
from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.model.loader import default_model_path, expected_shapes, load_model, read_hf_config
from worker.model.native import load_native_kernels
from worker.model.native_quant import QuantKernels
from worker.model.quant import (
    QK,
    QuantWeight,
    from_blocks,
    quantize,
)

# ---------------------------------------------------------------- dequantization and GGUF blocks


@pytest.mark.parametrize("kind", KINDS)
def test_from_blocks_dequantizes_as_gguf_does(kind: str) -> None:
    w = make_inputs(6, 4 * QK).numpy()
    raw = gguf.quants.quantize(w, KINDS[kind])  # (N, nb * block bytes)
    got = from_blocks(raw, KINDS[kind], (6, 4 * QK))
    assert got.shape == (6, 4 * QK) and got.source == kind.upper()
    np.testing.assert_array_equal(got.dequantize().numpy(), gguf.quants.dequantize(raw, KINDS[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_hand_packed_blocks_mean_what_gguf_says(kind: str) -> None:
    """This file's pack_blocks (behind the exact-integer tests) writes GGUF's layout."""
    rng = np.random.default_rng(3)
    ints = rng.integers(-128, 128, (4, 2 * QK)) if kind == "q8_0" else rng.integers(0, 16, (4, 2 * QK))
    d, m = rng.uniform(0.01, 1, (4, 2)), rng.uniform(-1, 1, (4, 2))
    raw = pack_blocks(kind, ints, d, m)
    want = gguf.quants.dequantize(raw, KINDS[kind])  # (4, 2 * QK)
    d16, m16 = np.repeat(d.astype(np.float16), QK, 1), np.repeat(m.astype(np.float16), QK, 1)
    by_hand = {"q8_0": d16 * ints, "q4_0": d16 * (ints - 8), "q4_1": d16 * ints + m16}[kind]
    np.testing.assert_allclose(want, by_hand, rtol=1e-6)
    np.testing.assert_array_equal(from_blocks(raw, KINDS[kind], (4, 2 * QK)).dequantize().numpy(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_rows_equals_dequantize(quant: QuantKernels, kind: str) -> None:
    w = make_weight(kind, 70, 3 * QK)  # 70 rows: the parallel loop
    full = w.dequantize()
    assert torch.equal(quant.dequantize_rows(w), full)
    ids = torch.tensor([69, 0, 5, 5], dtype=torch.int32)
    out = torch.full((4, 3 * QK), float("nan"))
    assert quant.dequantize_rows(w, ids, out=out) is out
    assert torch.equal(out, full[ids.long()])
    assert quant.dequantize_rows(w, torch.tensor([], dtype=torch.int64)).shape == (0, 3 * QK)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_quantize_rounds_each_weight_to_a_near_step(kind: str) -> None:
    w = make_inputs(8, 4 * QK)
    q = quantize(w, kind)
    assert q.shape == (8, 4 * QK) and q.source == kind.upper()
    assert quantize(w, kind, source="bf16").source == f"bf16->{kind.upper()}"
    step = q.d.abs().repeat_interleave(QK, dim=1)  # (N, C)
    # q8_0 rounds to the nearest of +-127 steps, q4_0 to 8 steps down but 7 up (the top loses up to one);
    # the step is stored in fp16 (relative error 2^-11), which moves the farthest level by 127 (8) times that
    bound = step * (0.5 + 127 * 2**-11 if kind == "q8_0" else 1 + 8 * 2**-11)
    assert ((q.dequantize() - w).abs() <= bound).all()
    assert nmse(q.dequantize(), w.double()) < (1e-4 if kind == "q8_0" else 2e-2)


# ---------------------------------------------------------------- Linears


@pytest.mark.parametrize("T", [5, 70])  # the one-row-tile remainders, then 2 x 4 tiles past one task
@pytest.mark.parametrize("kind", KINDS)
def test_linears_with_quantized_weights(quant: QuantKernels, kind: str, T: int) -> None:
    linears = Linears(CPU, torch.float32, quant)
    x = make_inputs(T, 4 * QK)
    w = make_weight(kind, 40, 4 * QK)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(8))
    want = float_linear(x, w) + bias.double()
    got = linears(x, linears.prepare(w), bias)
    assert got.shape == (T, 40) and nmse(got, want) < NMSE_MAX
    gate, up = make_weight(kind, 40, 4 * QK, seed=1), make_weight(kind, 40, 4 * QK, seed=2)
    fused = linears.fuse_gate_up(gate, up)
    got_mlp = linears.gate_up(x, fused)
    want_mlp = F.silu(float_linear(x, gate)) * float_linear(x, up)
    assert got_mlp.shape == (T, 40) and nmse(got_mlp, want_mlp) < NMSE_MAX
    # every row as it would be alone: the kernels are batch-invariant (resumes rely on it)
    assert torch.equal(linears(x[3:4], w, bias), got[3:4])


def test_linears_refuse_quantized_weights_without_kernels_or_mixed_pairs(quant: QuantKernels) -> None:
    w = make_weight("q8_0", 4, QK)
    with pytest.raises(ValueError, match="quantized weights need the C kernels"):
        Linears(CPU, torch.float32, None).prepare(w)
    with pytest.raises(ValueError, match="gate and up projections must both be quantized or both be float"):
        Linears(CPU, torch.float32, quant).fuse_gate_up(w, torch.ones(4, QK))


# ---------------------------------------------------------------- the real SmolLM2 GGUF (Q4_1, Q8_0 table)


@pytest.fixture(scope="module")
def smollm2_gguf() -> dict[str, Any]:
    return load_model(default_model_path(), quantize_to="gguf")[1]


@pytest.fixture(scope="module")
def smollm2_fp32() -> dict[str, Any]:
    return load_model(default_model_path())[1]


@pytest.mark.slow
def test_smollm2_keeps_its_gguf_blocks(smollm2_gguf: dict[str, Any], smollm2_fp32: dict[str, Any]) -> None:
    quantized = {n: w for n, w in smollm2_gguf.items() if isinstance(w, QuantWeight)}
    table = quantized.pop("model.embed_tokens.weight")  # tied: also the LM head
    assert len(quantized) == 30 * 7  # every linear of the 30 layers
    assert (table.format, table.source, table.shape) == ("q8", "Q8_0", (49152, 576))
    assert {(w.format, w.source) for w in quantized.values()} == {("q4", "Q4_1")}
    floats = {n for n, w in smollm2_gguf.items() if not isinstance(w, QuantWeight)}
    assert floats == {n for n, w in smollm2_fp32.items() if w.dim() == 1}  # the norms stay fp32 tensors
    assert {n: tuple(w.shape) for n, w in smollm2_gguf.items()} == {
        n: tuple(w.shape) for n, w in smollm2_fp32.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight", "model.layers.13.self_attn.v_proj.weight",
    "model.layers.13.mlp.gate_proj.weight", "model.layers.13.mlp.down_proj.weight"])
def test_smollm2_blocks_dequantize_to_the_fp32_load(smollm2_gguf: dict[str, Any],
                                                    smollm2_fp32: dict[str, Any], name: str) -> None:
    """q_proj and k_proj rows are permuted at load: the blocks must move with their rows."""
    assert torch.equal(smollm2_gguf[name].dequantize(), smollm2_fp32[name])


# ---------------------------------------------------------------- the factory


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded tiny Llama as a Hugging Face folder, written without transformers (its import takes ~4 s)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    g = torch.Generator().manual_seed(0)
    shapes = expected_shapes(read_hf_config(folder))
    save_file({name: torch.randn(shape, generator=g) * 0.1 + (len(shape) == 1)  # norms around 1
               for name, shape in shapes.items()}, str(folder / "model.safetensors"))
    return folder


def prefill_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of one prompt prefilled into a fresh cache."""
    n, block_size = len(ids), 16
    num_blocks = -(-n // block_size)
    cache = KVCache(model.config, num_blocks, block_size, model.dtype, model.device)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], context_lens=torch.tensor([n]).int(),
        query_start_loc=(0, n), context_lens_host=(n,), num_prefills=1, logits_indices=torch.arange(n))
    return model.forward(batch, cache)


def test_auto_keeps_a_safetensors_model_float(hf_folder: Path) -> None:
    model = build_model(EngineConfig(model=str(hf_folder), quantization="auto"))
    assert model.formats == [] and model.quantization_summary == "float32 weights"
    unquantized = build_model(EngineConfig(model=str(hf_folder), quantization="none"))
    ids = list(range(3, 23))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(unquantized, ids))


@pytest.mark.parametrize(("kind", "formats"), [
    ("q8_0", ["float32->Q8_0"]),
    ("q4_0", ["float32->Q4_0", "float32->Q8_0"])])  # the embedding table and the head stay Q8_0
def test_build_model_runs_a_safetensors_model_quantized_when_asked(quant: QuantKernels, hf_folder: Path,
                                                                   kind: str, formats: list[str]) -> None:
    model = build_model(EngineConfig(model=str(hf_folder), quantization=kind))
    assert model.quantization_summary == f"{', '.join(formats)} weights, {quant.isa} kernels"
    config, weights = load_model(hf_folder, quantize_to=kind)
    dequantized: dict[str, torch.Tensor | QuantWeight] = {
        n: w.dequantize() if isinstance(w, QuantWeight) else w for n, w in weights.items()}
    reference = LlamaModel(config, dequantized, kernels=load_native_kernels())  # same weights, fp32 maths
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    error = nmse(prefill_logits(model, ids), prefill_logits(reference, ids).double())
    assert 0 < error < NMSE_16BIT  # only the 16-bit rounding of the activations differs (~5e-9)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"dtype": "bfloat16"}, "dtype torch.bfloat16"),
    ({"enable_native_kernels": False}, "native kernels unavailable or disabled")])
def test_an_explicit_quantization_that_cannot_run_is_refused(hf_folder: Path, changes: dict[str, Any],
                                                             reason: str) -> None:
    config = EngineConfig(model=str(hf_folder), quantization="q8_0", **changes)
    with pytest.raises(ValueError, match=f"quantization q8_0 runs on CPU in float32 .*{re.escape(reason)}"):
        build_model(config)


def test_auto_keeps_a_gguf_quantized_only_where_the_kernels_run(hf_folder: Path) -> None:
    gguf_path, kernels = default_model_path(), load_native_kernels()
    assert kernels is not None
    assert quantize_to(EngineConfig(), gguf_path, CPU, torch.float32, kernels) == "gguf"
    assert quantize_to(EngineConfig(), gguf_path, CPU, torch.float32, None) is None
    assert quantize_to(EngineConfig(dtype="bfloat16"), gguf_path, CPU, torch.bfloat16, None) is None
    assert quantize_to(EngineConfig(quantization="none"), gguf_path, CPU, torch.float32, kernels) is None
    assert quantize_to(EngineConfig(), hf_folder, CPU, torch.float32, kernels) is None
