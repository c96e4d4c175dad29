"""LoRA adapters in the model (worker/model/lora.py, llama.py): PEFT folders in, the merged
model's outputs out, on the float path and on quantized weights with the C kernels."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.factories import greedy, make_engine, make_hf_model, make_prompts, ours_from_hf, run_to_completion  # noqa: E402
from tests.lora_factories import (  # noqa: E402
    adapter_tensors,
    dequantized_hf,
    lora_engine,
    lora_key,
    merged_hf,
    write_adapter,
)
from worker.model.llama import ForwardBatch, KVCache, LlamaModel  # noqa: E402
from worker.model.lora import TARGET_MODULES, LoraAdapter, load_adapter  # noqa: E402

R, ALPHA = 4, 8  # scale 2


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return make_hf_model()


def prompt_logits(model: LlamaModel, prompt: list[int], adapter: LoraAdapter | None = None) -> torch.Tensor:
    """Logits (n, V) of every position of one prompt, in one forward (`adapter` on every row)."""
    n, bs = len(prompt), 4
    cache = KVCache(model.config, -(-n // bs), bs, model.dtype, torch.device("cpu"))
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt), positions=torch.arange(n), slot_mapping=torch.arange(n),
        block_tables=torch.arange(-(-n // bs), dtype=torch.int32)[None],
        context_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=(0, n), context_lens_host=(n,),
        num_prefills=1, logits_indices=torch.arange(n),
        lora_slots=torch.zeros(n, dtype=torch.int64) if adapter else None,  # (n,)
        adapters=(adapter,) if adapter else ())
    return model.forward(batch, cache)


def test_a_zero_adapter_gives_exactly_the_base_models_logits_and_tokens(hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = lora_engine(hf, quantize_to="q8_0")
    engine.adapters.load("zero", write_adapter(tmp_path, adapter_tensors(hf, is_zero=True)))  # type: ignore[union-attr]
    prompt = make_prompts(1, lengths=(13,))[0]
    zero = engine.adapters.get("zero")  # type: ignore[union-attr]
    assert torch.equal(prompt_logits(engine.model, prompt, zero), prompt_logits(engine.model, prompt))
    engine.add_request("base", prompt, greedy(12))
    engine.add_request("zero", prompt, greedy(12), adapter="zero")
    got = run_to_completion(engine)
    assert got["zero"] == got["base"] and len(got["base"]) == 12


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_greedy_tokens_equal_the_merged_models(hf, tmp_path: Path, native: bool) -> None:  # type: ignore[no-untyped-def]
    """Float weights: the adapter's update on top of W gives the tokens of W + scale * B @ A, and
    they are not the base model's (else the check could not fail)."""
    tensors = adapter_tensors(hf, r=R, seed=1)
    engine = lora_engine(hf, native=native)
    engine.adapters.load("a", write_adapter(tmp_path, tensors, r=R, alpha=ALPHA))  # type: ignore[union-attr]
    merged = make_engine(ours_from_hf(merged_hf(hf, tensors, ALPHA / R), native=native))
    prompts = make_prompts(3, lengths=(5, 17, 30), seed=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"lora{i}", p, greedy(10), adapter="a")
        engine.add_request(f"base{i}", p, greedy(10))
        merged.add_request(f"lora{i}", p, greedy(10))
    got, want = run_to_completion(engine), run_to_completion(merged)
    for i in range(3):
        assert got[f"lora{i}"] == want[f"lora{i}"], f"prompt {i}"
    assert any(got[f"lora{i}"] != got[f"base{i}"] for i in range(3))
    logits = prompt_logits(engine.model, prompts[1], engine.adapters.get("a"))  # type: ignore[union-attr]
    torch.testing.assert_close(logits, prompt_logits(merged.model, prompts[1]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_on_quantized_weights_the_update_is_added_in_fp32(hf, tmp_path: Path, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Quantized weights: merging into W and quantizing again would round the update away, so
    the reference is a float model with the dequantized weights plus the update, merged. The
    kernels also round activations to int16 blocks, so the quantized base model is not that
    reference's base either: its own distance to it (err_base) is the tolerance. The update must
    move the logits much further than that, and the adapter path must stay as close to its
    reference as the base path is to its own; a dropped, doubled or misplaced update (a gate/up
    mix-up in the interleaved rows) moves them by the update's size. Measured: err_base ~1.7e-5,
    err_lora ~1.4e-5, effect ~1.0 for both kinds."""
    tensors = adapter_tensors(hf, r=R, seed=3)
    model = ours_from_hf(hf, quantize_to=kind)
    model.enable_lora()
    assert model.decode_layers is not None  # the fused layers exist, and LoRA keeps them unused
    adapter = load_adapter("a", write_adapter(tmp_path, tensors, r=R, alpha=ALPHA), model.config)
    dequantized = dequantized_hf(hf, kind)
    ref_base = ours_from_hf(dequantized, native=False)
    ref_lora = ours_from_hf(merged_hf(dequantized, tensors, ALPHA / R), native=False)
    prompt = make_prompts(1, lengths=(21,), seed=4)[0]
    got_base, got_lora = prompt_logits(model, prompt), prompt_logits(model, prompt, adapter)
    want_base, want_lora = prompt_logits(ref_base, prompt), prompt_logits(ref_lora, prompt)
    err_base = (got_base - want_base).abs().max().item()
    err_lora = (got_lora - want_lora).abs().max().item()
    effect = (want_lora - want_base).abs().max().item()
    assert err_lora <= 2 * err_base + 1e-5, (err_lora, err_base)
    assert effect > 50 * err_lora, (effect, err_lora)


def test_rank_scale_and_rslora(hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = ours_from_hf(hf).config
    tensors = adapter_tensors(hf, r=8, modules=("q_proj", "down_proj"))
    plain = load_adapter("p", write_adapter(tmp_path / "p", tensors, r=8, alpha=16), config)
    rs = load_adapter("r", write_adapter(tmp_path / "r", tensors, r=8, alpha=16, use_rslora=True), config)
    assert (plain.rank, plain.scale, rs.scale) == (8, 2.0, 16 / math.sqrt(8))
    assert plain.modules == ("q_proj", "down_proj")
    assert set(plain.layers[0]) == {"qkv", "down"}  # o and gate/up untouched
    qkv = plain.layers[0]["qkv"]
    assert qkv.a_t.shape == (64, 8) and qkv.b_t.shape == (8, 64 + 2 * 32)  # q, k and v columns
    assert not qkv.b_t[:, 64:].any()  # k and v get nothing


def _drop(tensors: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k != key}


BAD = {  # what is wrong -> (adapter_config.json fields, tensors edit, the message's words)
    "dora": ({"use_dora": True}, None, "use_dora"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, None, "fan_in_fan_out"),
    "bias": ({"bias": "lora_only"}, None, "bias"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "prefix_tuning": ({"peft_type": "PREFIX_TUNING"}, None, "peft_type"),
    "rank_too_large": ({"r": 65}, None, r"r must be an integer in \[1, max_lora_rank = 64\]"),
    "unknown_target": ({"target_modules": ["q_proj", "lm_head"]}, None, r"target_modules \['lm_head'\]"),
    "undeclared_module": ({"target_modules": ["q_proj"]}, None, "that adapter_config.json's target_modules"),
    "rank_mismatch": ({"r": 8}, None, r"lora_A is \(4, 64\); r = 8"),
    "shape": ({}, lambda t: t | {lora_key(0, "v_proj", "B"): torch.zeros(64, 4)},
              r"layer 0 v_proj: lora_B is \(64, 4\)"),
    "missing_b": ({}, lambda t: _drop(t, lora_key(1, "o_proj", "B")),
                  "layer 1 o_proj: has lora_A without lora_B"),
    "layer": ({}, lambda t: t | {lora_key(2, "q_proj", "A"): torch.zeros(4, 64)},
              "is for layer 2; the model has 2"),
    "embedding": ({"target_modules": ["q_proj"]},
                  lambda t: t | {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128)},
                  "is not a LoRA weight of a supported module"),
    "nan": ({}, lambda t: t | {lora_key(0, "q_proj", "A"): torch.full((4, 64), math.nan)}, "finite floats"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_files_are_refused_naming_the_problem(hf, tmp_path: Path, case: str) -> None:  # type: ignore[no-untyped-def]
    fields, edit, message = BAD[case]
    tensors = adapter_tensors(hf, r=R)
    folder = write_adapter(tmp_path, edit(tensors) if edit else tensors, **({"r": R} | fields))
    with pytest.raises(ValueError, match=message):
        load_adapter("bad", folder, ours_from_hf(hf).config)


def test_missing_files_are_refused_naming_them(hf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = ours_from_hf(hf).config
    with pytest.raises(ValueError, match="is not a folder"):
        load_adapter("x", tmp_path / "nowhere", config)
    folder = Path(write_adapter(tmp_path / "a", adapter_tensors(hf)))
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"safetensors: missing \(adapter_model.bin is not read"):
        load_adapter("x", folder, config)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="adapter_config.json: missing"):
        load_adapter("x", folder, config)
    (folder / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(ValueError, match="adapter_config.json: not readable JSON"):
        load_adapter("x", folder, config)


def packed_logits(model: LlamaModel, prompts: list[list[int]], slots: list[int],
                  adapters: tuple[LoraAdapter, ...]) -> torch.Tensor:
    """Logits (sum of lengths, V) of every position of several prompts in one forward, prompt i
    with adapters[slots[i]] (-1: none)."""
    bs, tables, rows, start = 4, [], [], 0
    for p in prompts:
        tables.append(list(range(start, start - (-len(p) // bs))))
        start = tables[-1][-1] + 1
    width = max(map(len, tables))
    lens = [len(p) for p in prompts]
    starts = [sum(lens[:i]) for i in range(len(prompts) + 1)]
    for p, table in zip(prompts, tables, strict=True):
        rows += [table[j // bs] * bs + j % bs for j in range(len(p))]
    cache = KVCache(model.config, start, bs, model.dtype, torch.device("cpu"))
    batch = ForwardBatch(
        input_ids=torch.tensor([t for p in prompts for t in p]),
        positions=torch.tensor([j for p in prompts for j in range(len(p))]), slot_mapping=torch.tensor(rows),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=tuple(starts),
        context_lens_host=tuple(lens), num_prefills=len(prompts), logits_indices=torch.arange(starts[-1]),
        lora_slots=torch.tensor([s for s, n in zip(slots, lens, strict=True) for _ in range(n)]),  # (T,)
        adapters=adapters)
    return model.forward(batch, cache)


@pytest.mark.parametrize("quantize_to", [None, "q8_0"])
def test_each_rows_logits_are_bitwise_those_it_gets_alone(hf, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          quantize_to: str | None) -> None:
    """Tokens of a tiny model hide last-bit differences, so compare the logits: the C kernels'
    path, every token a decode row, adapters over all or some of the matmuls. A plain matmul for
    the update (whose kernel depends on the row count) fails here: the 1-token prompt is one row
    alone and seven next to prompt 0; the engine-level test's tokens did not see it."""
    model = ours_from_hf(hf, quantize_to=quantize_to)
    model.enable_lora()
    mods = {0: TARGET_MODULES, 1: ("q_proj", "up_proj")}
    folders = [write_adapter(tmp_path / str(i), adapter_tensors(hf, seed=i, modules=mods[i % 2], std=0.6))
               for i in range(3)]  # updates about as large as W x, so that a last bit of theirs shows
    adapters = tuple(load_adapter(f"x{i}", folder, model.config) for i, folder in enumerate(folders))
    prompts = make_prompts(6, lengths=(5, 13, 1, 21), seed=9)  # a 1-token prompt: a row alone, as a decode
    slots = [0, 1, 0, 2, -1, 1]
    together = packed_logits(model, prompts, slots, adapters).split([len(p) for p in prompts])
    for i, (p, s) in enumerate(zip(prompts, slots, strict=True)):
        alone = packed_logits(model, [p], [min(s, 0)], adapters[s:s + 1] if s >= 0 else ())
        assert torch.equal(together[i], alone), f"prompt {i}"
