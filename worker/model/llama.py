"""A Llama-family decoder as plain maths over a paged KV cache.

No I/O, no scheduling: the model runner flattens one step's new tokens (prompt
chunks first, then one token per decoding sequence) and says where each one's
K/V go and which cache blocks each sequence reads (`ForwardBatch`, vLLM's
attention metadata). Two attention paths: a prompt chunk attends causally over
its cached prefix and itself; a decode token attends over its sequence's
cache (attention.py has the cache, the batch and the torch attention). With
LoRA enabled, each row may carry an adapter whose low-rank update is added to
its rows of every adapted matmul (lora.py). Shapes: T new tokens in the step, S
sequences, C hidden size, F ffn size, H query heads, K kv heads, D head dim, N
cache blocks of Bs tokens, M blocks per block table, V vocab.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.arena import into_huge_pages
from worker.model.attention import ForwardBatch, KVCache, rows_as_decodes
from worker.model.attn_backends import StepPlan
from worker.model.attn_choice import make_backend
from worker.model.config import ModelConfig
from worker.model.linear import Linears, Weight
from worker.model.lora import LoraRows
from worker.model.native import NativeKernels
from worker.model.native_layers import DecodeLayers
from worker.model.quant import QuantWeight, cat_rows
from worker.model.rope import apply_rope, rope_tables

__all__ = ["ForwardBatch", "KVCache", "LayerWeights", "LlamaModel", "rms_norm"]


@dataclass
class _Step:
    """What every layer of one per-op forward reads besides its weights."""

    cos: torch.Tensor  # (T, 1, D)
    sin: torch.Tensor  # (T, 1, D)
    attention: StepPlan  # the attention backend's metadata, built once per step
    lora: LoraRows | None  # the step's adapted rows


@dataclass
class LayerWeights:
    """Matmul weights are float tensors or QuantWeights, in their kernel's layout (linear.py)."""

    attn_norm: torch.Tensor  # (C,)
    wqkv: Weight  # ((H + 2K) * D, C): q, k and v projections fused into one matmul
    bqkv: torch.Tensor | None  # ((H + 2K) * D,) when attention_bias
    wo: Weight  # (C, H * D)
    bo: torch.Tensor | None  # (C,) when attention_bias
    mlp_norm: torch.Tensor  # (C,)
    w_gate_up: Weight  # (2 * F, C): gate and up fused
    w_down: Weight  # (C, F)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # torch's own op, bit-identical to the maths below in fp32
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 kernels: NativeKernels | None = None, enable_lora: bool = False,
                 attention: str = "auto") -> None:
        """`kernels`: the C kernels (worker/model/native.py) for CPU decode attention,
        RMSNorm and quantized weights, built by the caller; None keeps the torch path
        (CUDA, half precision), which cannot run QuantWeights. `enable_lora`: see enable_lora().
        `attention`: the attention backend (attn_backends.make_backend: cpu, torch, flashinfer
        or auto)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        if kernels is not None and (self.device.type != "cpu" or dtype != torch.float32):
            raise ValueError(f"the C kernels run fp32 on CPU, not {dtype} on {self.device}")
        self.kernels = kernels
        self.attention = make_backend(attention, kernels, self.device, config.num_heads, dtype)
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            kernels.rms_norm if kernels is not None else rms_norm)
        self.linear = Linears(self.device, dtype, kernels.quant if kernels is not None else None)
        # the sampler's one-pass argmax for all-greedy steps (None: torch's)
        self.greedy_argmax = kernels.greedy_argmax if kernels is not None else None
        self.formats = sorted({w.source for w in weights.values() if isinstance(w, QuantWeight)})
        self.embed = self._take(weights, "model.embed_tokens.weight")  # (V, C)
        lm_head = weights.pop("lm_head.weight", None)
        # A tied float head is packed from the embedding, which F.embedding needs plain: with
        # oneDNN that is a copy (V * C * 4 bytes, 113 MB for SmolLM2), bought for speed:
        # the head's matmul at 16 rows took 9.6 ms packed vs 14.4 ms plain (5% of a step).
        # With F.linear, pack is the identity and the two share memory, as a quantized table does.
        head = self.embed if lm_head is None else self._to_device(lm_head)
        self.lm_head = self.linear.prepare(head)  # (V, C)
        if lm_head is None and isinstance(self.embed, QuantWeight):
            self.embed = self.lm_head  # tied: one copy, in the head's layout (dequantize_rows reads any)
        self.norm = self._take(weights, "model.norm.weight")  # (C,)
        self.layers = [self._take_layer(weights, i) for i in range(config.num_layers)]
        self._arena = self._quantized_into_huge_pages()
        # computed in fp32, then stored in the model's dtype (as transformers does), so
        # half-precision activations are not promoted to fp32 by the rotation
        cos, sin = rope_tables(config, config.max_position_embeddings, self.device)  # (P, D)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.decode_layers = self._fused_decode_layers()
        self.is_lora_enabled = False
        if enable_lora:
            self.enable_lora()

    def enable_lora(self) -> None:
        """Let batches carry LoRA adapters (ForwardBatch.adapters). Every step then runs per op,
        with or without adapter rows: the fused C layers (decode_layers) have no place for an
        update, and a base request's floats must not depend on whether an adapter request shares
        its step. On the C kernels, every token still attends as a decode row, and gate/up is
        computed before the activation (the kernel's SiLU-mul epilogue would hide it), then
        SiLU-mul in torch. What that costs (`make bench-lora`, SmolLM2 Q4_1 GGUF, 16 requests of
        64 tokens, 2 threads, AVX-512 VNNI Xeon, 2026-12-05, 3 runs): fused 334 decode tok/s (195
        overall), per op 282 (173): 0.84x decode, 0.88x overall. The adapters' own cost comes on
        top: 4 rank-16 adapters over all seven modules cost ~6.6 ms a step at 16 rows in the C
        update (kernels/lora.c; ~19 ms as per-row bmm calls), 0.92x the base requests' tok/s
        (LoraRows.add has the numbers)."""
        self.is_lora_enabled = True

    def _quantized_into_huge_pages(self) -> mmap.mmap | None:
        """The quantized matmul weights and head moved into one mapping of 2 MiB pages, which a
        decode step streams faster (arena.py); the mapping, or None with nothing quantized or
        where the system has no such advice (the weights then stay where they are)."""
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return None
        found = [(layer, name) for layer in self.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")
                 if isinstance(getattr(layer, name), QuantWeight)]
        weights = [getattr(layer, name) for layer, name in found]
        head = self.lm_head if isinstance(self.lm_head, QuantWeight) else None
        if not weights and head is None:
            return None
        moved, area = into_huge_pages(weights if head is None else [*weights, head])
        if head is not None:
            self.lm_head = moved.pop()
            self.embed = self.lm_head if self.embed is head else self.embed
        for (layer, name), w in zip(found, moved, strict=True):
            setattr(layer, name, w)
        return area

    def _fused_decode_layers(self) -> DecodeLayers | None:
        """All layers of a step in one C call (kernels/layer.c), where every matmul
        weight is quantized and the shapes are ones the C code takes; else None (per op)."""
        cfg = self.config
        weights = [w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        if (self.kernels is None or self.attention.name != "cpu"
                or not all(isinstance(w, QuantWeight) for w in weights)
                or cfg.head_dim > 512 or (cfg.num_heads * cfg.head_dim) % 32):
            return None
        return self.kernels.decode_layers(self.layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                                          kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                          ffn=cfg.intermediate_size, eps=cfg.rms_norm_eps, cos=self.cos,
                                          sin=self.sin)

    def new_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVCache:
        """A KV cache in the layout this model's attention backend reads."""
        return KVCache(self.config, num_blocks, block_size, dtype or self.dtype, self.device,
                       self.attention.cache_layout)

    def _to_device(self, w: torch.Tensor | QuantWeight) -> Any:
        return w if isinstance(w, QuantWeight) else w.to(self.device, self.dtype)

    def _take(self, weights: dict[str, torch.Tensor | QuantWeight], name: str) -> Any:
        return self._to_device(weights.pop(name))

    def _take_layer(self, w: dict[str, torch.Tensor | QuantWeight], i: int) -> LayerWeights:
        p = f"model.layers.{i}."

        def take(name: str) -> Any:
            return self._take(w, p + name)

        qkv = [take(f"self_attn.{n}_proj.weight") for n in "qkv"]
        bias = ([take(f"self_attn.{n}_proj.bias") for n in "qkv"]
                if self.config.attention_bias else None)
        prepare = self.linear.prepare
        return LayerWeights(
            attn_norm=take("input_layernorm.weight"),
            wqkv=prepare(cat_rows(qkv) if isinstance(qkv[0], QuantWeight) else torch.cat(qkv, dim=0)),
            bqkv=torch.cat(bias, dim=0) if bias else None,
            wo=prepare(take("self_attn.o_proj.weight")),
            bo=take("self_attn.o_proj.bias") if self.config.attention_bias else None,
            mlp_norm=take("post_attention_layernorm.weight"),
            w_gate_up=self.linear.fuse_gate_up(take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")),
            w_down=prepare(take("mlp.down_proj.weight")),
        )

    @property
    def quantization_summary(self) -> str:
        """Which formats and kernels run, for the start-up log and GetServerInfo."""
        quant = self.linear.quant
        if not self.formats or quant is None:
            return f"{str(self.dtype).removeprefix('torch.')} weights"
        return f"{', '.join(self.formats)} weights, {quant.isa} kernels"

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run the step's T new tokens, writing their K/V into the cache.

        Returns float32 logits (R, V) of the tokens in batch.logits_indices.
        """
        x = self._embed(batch.input_ids)  # (T, C)
        if batch.adapters and not self.is_lora_enabled:
            raise ValueError("a batch with LoRA adapters needs a model with enable_lora")
        if self.decode_layers is not None and not self.is_lora_enabled:  # the cpu backend, fused
            tables, lens = rows_as_decodes(batch)
            self.decode_layers(x, batch.positions, batch.slot_mapping, tables, lens, cache.k, cache.v)
            return self._logits(x, batch)  # x was updated in place
        step = _Step(
            cos=self.cos[batch.positions].unsqueeze(1), sin=self.sin[batch.positions].unsqueeze(1),
            attention=self.attention.plan(batch, cache, all_rows_as_decodes=self.is_lora_enabled),
            lora=(LoraRows(batch.lora_slots, batch.adapters, self.kernels.lora if self.kernels else None)
                  if batch.lora_slots is not None else None))
        for i, layer in enumerate(self.layers):
            h = self.rms_norm(x, layer.attn_norm, self.config.rms_norm_eps)  # (T, C)
            x = x + self._attention(h, layer, cache, i, step)
            h = self.rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)  # (T, C)
            x = x + self._mlp(h, layer, i, step.lora)
        return self._logits(x, batch)

    def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.rms_norm(x[batch.logits_indices], self.norm, self.config.rms_norm_eps)  # (R, C)
        return self.linear(x, self.lm_head).float()  # (R, V)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantWeight):
            assert self.linear.quant is not None
            return self.linear.quant.dequantize_rows(self.embed, ids)  # (T, C)
        return F.embedding(ids, self.embed)  # (T, C)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: KVCache, i: int,
                   step: _Step) -> torch.Tensor:
        cfg = self.config
        T = h.shape[0]
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.linear(h, layer.wqkv, layer.bqkv)  # (T, (H + 2K) * D)
        if step.lora is not None:
            step.lora.add(i, "qkv", h, qkv)
        qk, v = qkv.split(((H + K) * D, K * D), dim=-1)
        qk = apply_rope(qk.view(T, H + K, D), step.cos, step.sin)  # (T, H + K, D): one rotation for both
        q, k = qk[:, :H], qk[:, H:]  # (T, H, D), (T, K, D)
        v = v.view(T, K, D)
        self.attention.write(cache, i, k, v, step.attention)  # all of the step's, before any row attends
        out = self.attention.forward(i, q, k, v, cache, step.attention)  # (T, H, D)
        attn = out.reshape(T, H * D)  # (T, H * D)
        y = self.linear(attn, layer.wo, layer.bo)  # (T, C)
        if step.lora is not None:
            step.lora.add(i, "o", attn, y)
        return y

    def _mlp(self, h: torch.Tensor, layer: LayerWeights, i: int, lora: LoraRows | None) -> torch.Tensor:
        if not self.is_lora_enabled:
            return self.linear(self.linear.gate_up(h, layer.w_gate_up), layer.w_down)  # (T, F) -> (T, C)
        gate_up = self.linear(h, layer.w_gate_up)  # (T, 2F)
        if isinstance(layer.w_gate_up, QuantWeight):  # rows gate_i, up_i interleaved for the C epilogue
            T, F2 = gate_up.shape
            gate_up = gate_up.view(T, F2 // 2, 2).transpose(1, 2).reshape(T, F2)  # (T, 2F): gate, then up
        if lora is not None:
            lora.add(i, "gate_up", h, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, F) each
        act = F.silu(gate) * up  # (T, F): as Linears.gate_up computes it for float weights
        y = self.linear(act, layer.w_down)  # (T, C)
        if lora is not None:
            lora.add(i, "down", act, y)
        return y
