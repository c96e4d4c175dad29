"""Llama weights from a GGUF file (llama.cpp's format), dequantised to torch or kept quantized.

Each tensor is dequantised by the `gguf` package (numpy), converted to the
requested dtype and the numpy buffer dropped before the next one, so peak
memory is the finished weights plus one tensor in flight. With `quantize`
set, 2-D weights (the linears and the embedding table) become QuantWeights
instead (worker/model/quant.py): kept in their own Q4_0/Q4_1/Q8_0 blocks
("gguf"), or requantized ("q8_0", "q4_0"; any other type becomes Q8_0).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import torch

from worker.model.config import ModelConfig
from worker.model.gguf_meta import GGUFMetadata, GGUFTensorInfo, end_of_generation_ids, read_gguf_metadata
from worker.model.quant import KEPT_TYPES, QuantWeight, from_blocks, quantize
from worker.model.rope import check_rope_scaling

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        if gguf_name == "rope_freqs.weight":
            raise ValueError("GGUF rope_freqs (llama3 RoPE scaling stored as a tensor) is not supported")
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF file")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rope_rows(w: torch.Tensor | QuantWeight, num_heads: int) -> torch.Tensor | QuantWeight:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each
    head's two RoPE halves; Hugging Face keeps them as halves).

    w: (num_heads * head_dim, ...) -> same shape, Hugging Face row order.
    """
    if isinstance(w, QuantWeight):  # whole rows move: the same order applied to row numbers
        order = unpermute_rope_rows(torch.arange(w.shape[0]), num_heads)
        assert isinstance(order, torch.Tensor)
        return w.rows(order)
    rows = w.shape[0]
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...): pairs become halves
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _raw(file: BinaryIO, t: GGUFTensorInfo) -> np.ndarray:
    # Read, not mmap: only one tensor's quantised bytes are resident at a time.
    file.seek(t.offset)
    raw = np.fromfile(file, dtype=np.uint8, count=t.num_bytes)
    if raw.size != t.num_bytes:
        raise ValueError(f"{t.name}: GGUF file is truncated")
    return raw.reshape(t.byte_shape)


def _to_numpy(file: BinaryIO, t: GGUFTensorInfo) -> np.ndarray:
    """Dequantised float32 array in numpy (= Hugging Face) order, owning its memory."""
    raw = _raw(file, t)
    try:
        return gguf.quants.dequantize(raw, t.qtype).reshape(t.shape)
    except NotImplementedError as e:
        raise ValueError(f"{t.name}: GGUF tensor type {t.qtype.name} cannot be dequantised") from e


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict[str, Any] | None:
    """llama.cpp's rope scaling keys as a Hugging Face rope_scaling dict, checked against rope.py."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta.get(f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind)}
    if factor is not None:
        scaling["factor"] = float(factor)
    if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    check_rope_scaling(scaling)
    return scaling


def read_gguf_config(meta: GGUFMetadata) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    shapes = {t.name: t.shape for t in meta.tensors}

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{meta.path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{meta.path}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab_size and "token_embd.weight" in shapes:
        vocab_size = shapes["token_embd.weight"][0]  # (vocab, hidden)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=end_of_generation_ids(meta),
        name=str(meta.get("general.name", meta.path.stem)),
    )


def load_gguf(path: str | Path, dtype: torch.dtype, quantize_to: str | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight]]:
    """`quantize_to`: None (all dequantised to dtype), "gguf", "q8_0" or "q4_0" (see above)."""
    meta = read_gguf_metadata(path)
    config = read_gguf_config(meta)
    names = {t.name: hf_tensor_name(t.name) for t in meta.tensors}  # fail on unknown names before any work
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    with open(meta.path, "rb") as file:
        for t in meta.tensors:
            name = names[t.name]
            w: torch.Tensor | QuantWeight
            if quantize_to is not None and len(t.shape) == 2:
                w = _quantized(file, t, quantize_to)
            else:
                # shares the fresh numpy buffer; a float32 source is freed here when dtype differs
                w = torch.from_numpy(_to_numpy(file, t)).to(dtype)
            heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
            for part, num_heads in heads.items():
                if f".{part}." in name:
                    w = unpermute_rope_rows(w, num_heads)
            tensors[name] = w
            del w
    return config, tensors


def _quantized(file: BinaryIO, t: GGUFTensorInfo, quantize_to: str) -> QuantWeight:
    """A 2-D tensor as a QuantWeight: its own blocks where it has a kept type (and "gguf",
    or the asked type), else dequantised and requantized (Q8_0 for "gguf")."""
    shape = (t.shape[0], t.shape[1])
    wanted = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}.get(quantize_to)
    if t.qtype in KEPT_TYPES and wanted in (None, t.qtype):
        return from_blocks(_raw(file, t), t.qtype, shape)
    kind = quantize_to if wanted is not None else "q8_0"
    return quantize(torch.from_numpy(_to_numpy(file, t)), kind, source=t.qtype.name)
