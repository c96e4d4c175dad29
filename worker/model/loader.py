"""Load a Llama-family model: GGUF file or Hugging Face folder -> (ModelConfig, weights).

Weights are returned under Hugging Face Llama names with `nn.Linear` shapes
(out_features, in_features), whatever the file format, so `model/llama.py`
only ever sees one layout. `lm_head.weight` is present only when the
embeddings are not tied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.model.config import ModelConfig
from worker.model.gguf_loader import load_gguf
from worker.model.gguf_meta import default_model_path
from worker.model.quant import QUANTIZE_TYPES, QuantWeight, quantize
from worker.model.rope import check_rope_scaling, rope_type

__all__ = ["check_weights", "default_model_path", "expected_shapes", "load_model"]

# Architectures whose checkpoints have exactly the Llama tensor layout.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, quantize_to: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight]]:
    """Read a `.gguf` file or a folder with `config.json` + `*.safetensors`.

    quantize_to: None keeps every weight a `dtype` tensor; "gguf" keeps a GGUF's
    Q4_0/Q4_1/Q8_0 linears and embeddings in their blocks (others become Q8_0; a
    safetensors model stays float); "q8_0"/"q4_0" quantize them all (the embedding
    table and LM head to Q8_0, as llama.cpp keeps its output at higher precision)."""
    path = default_model_path() if path is None else Path(path)
    tensors: dict[str, torch.Tensor | QuantWeight]
    if path.is_file() and path.suffix == ".gguf":
        config, tensors = load_gguf(path, dtype, quantize_to)
    elif path.is_dir() and (path / "config.json").is_file():
        config, floats = load_hf_folder(path, dtype)
        tensors = dict(floats)
        if quantize_to in QUANTIZE_TYPES:
            for name, w in tensors.items():
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    is_table = name in ("model.embed_tokens.weight", "lm_head.weight")
                    tensors[name] = quantize(w, "q8_0" if is_table else quantize_to, source=str(w.dtype)[6:])
    else:
        raise ValueError(f"{path}: expected a .gguf file or a folder with config.json and *.safetensors")
    check_weights(config, tensors)
    return config, tensors


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its Hugging Face shape."""
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, h),
            p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h),
            p + "self_attn.o_proj.weight": (h, q_rows),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.attention_bias:
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("o", h)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
    return shapes


def check_weights(config: ModelConfig, tensors: Mapping[str, torch.Tensor | QuantWeight]) -> None:
    """ValueError naming missing, unexpected or mis-shaped tensors."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        more = " ..." if len(missing) > 10 else ""
        raise ValueError(f"missing tensors: {', '.join(missing[:10])}{more}")
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        raise ValueError(f"unexpected tensors: {', '.join(unexpected[:10])}")
    wrong = [f"{n} {tuple(t.shape)} != {shapes[n]}" for n, t in tensors.items()
             if tuple(t.shape) != shapes[n]]
    if wrong:
        raise ValueError(f"wrong tensor shapes: {'; '.join(wrong[:10])}")


def _token_ids(value: Any) -> tuple[int, ...]:
    """`eos_token_id` may be an int, a list or null."""
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x or 5.x config.json."""
    if isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5
        params = dict(cfg["rope_parameters"])
        theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        params = dict(cfg.get("rope_scaling") or {})
    kind = rope_type(params)
    params.pop("type", None)
    if kind == "default":
        return theta, None
    scaling = {**params, "rope_type": kind}
    check_rope_scaling(scaling)  # fail at load, naming the type, not when the model is built
    return theta, scaling


def read_hf_config(folder: Path) -> ModelConfig:
    cfg = json.loads((folder / "config.json").read_text())
    arch = (cfg.get("architectures") or [f"<model_type {cfg.get('model_type')!r}>"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"{folder}: architecture {arch} is not supported (supported: {supported})")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if window is not None and int(window) < max_pos:
        raise ValueError(f"{folder}: sliding-window attention ({window} < {max_pos}) is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{folder}: mlp_bias=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    theta, scaling = _rope(cfg)
    eos = _token_ids(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():  # what `generate` stops on; often a superset of config.json's
        gen_eos = _token_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        eos += tuple(i for i in gen_eos if i not in eos)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=folder.name,
    )


def load_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files (.bin checkpoints are not supported)")
    wanted = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                # Skips a tied lm_head copy and buffers such as rotary_emb.inv_freq.
                if name in wanted:
                    tensors[name] = f.get_tensor(name).to(dtype)
    return config, tensors
