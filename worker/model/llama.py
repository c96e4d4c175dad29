"""A Llama-family decoder as plain maths over a static, slot-indexed KV cache.

No I/O, no scheduling: the model runner decides which cache slot and which
positions each row of the batch uses. Shapes: B batch rows, T tokens per row,
C hidden size, H query heads, K kv heads, D head dim, S cache slots, L tokens
per slot, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.native import DecodeAttention, load_native_kernels
from worker.model.rope import apply_rope, rope_tables


@dataclass
class ForwardBatch:
    """Where each row of a forward pass reads and writes the KV cache."""

    input_ids: torch.Tensor  # (B, T)
    positions: torch.Tensor  # (B, T) absolute position of each token
    slot_ids: torch.Tensor  # (B,) cache slot of each row
    kv_len: int  # attend over cache positions [0, kv_len), masked per row by position
    slot_range: slice | None = None  # slot_ids as a range: the cache is read as a view
    # False when every query may see all kv_len keys (one decode row, or rows all
    # at the same position): attention then runs without a mask.
    needs_mask: bool = True
    # Packed prefill: B == 1 and the row holds prompt chunks back to back; chunk s
    # spans [bounds[s], bounds[s + 1]). A chunk starting at position 0 attends
    # causally within itself, so the cache is not read back; the matmuls see all
    # tokens at once and no compute goes to padding. Logits are returned for the
    # last token of each chunk: (num_chunks, V).
    segment_bounds: tuple[int, ...] | None = None
    token_slots: torch.Tensor | None = None  # (B, T) cache slot of each token; None = slot_ids per row
    # Chunked prefill: absolute position of each segment's first token (None = all 0).
    # A segment starting later attends to its slot's cached keys [0, start) too.
    segment_starts: tuple[int, ...] | None = None
    segment_slots: tuple[int, ...] | None = None  # cache slot of each segment (host ints)
    # Mixed step (native decode attention only): the packed row ends with one decode
    # token for each of these slots, after the last segment; their logits follow the
    # segments'. Weights are then read once per step, not once for prompts and again
    # for decodes.
    decode_slot_ids: torch.Tensor | None = None  # (num_decodes,)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (C,)
    wqkv: torch.Tensor  # ((H + 2K) * D, C): q, k and v projections fused into one matmul
    bqkv: torch.Tensor | None  # ((H + 2K) * D,) when attention_bias
    wo: torch.Tensor  # (C, H * D)
    mlp_norm: torch.Tensor  # (C,)
    w_gate_up: torch.Tensor  # (2 * F, C): gate and up fused
    w_down: torch.Tensor  # (C, F)


class KVCache:
    """K and V for every layer, allocated once: each (num_layers, S, K, L, D)."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (N, S, K, L, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (N, S, K, L, D)
        self.num_slots = num_slots
        self.max_len = max_len


PACK_ROWS_HINT = 16  # oneDNN picks the blocked weight layout for this many rows (a decode batch)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")


@dataclass(frozen=True)
class LinearKernel:
    """The matmul `linear(x, w, b)` and how weights must be prepared for it (`pack`)."""

    linear: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)


def pick_linear(device: torch.device, dtype: torch.dtype) -> LinearKernel:
    """oneDNN with weights pre-packed into its blocked layout on CPU fp32, else F.linear.

    Measured on our 2-core CPUs (SmolLM2 shapes, weights streamed from DRAM as in
    a real step): a decode step's 121 matmuls at 16 rows take 60 ms packed vs
    80 ms with oneDNN on plain weights and 90 ms with BLAS (F.linear); at 1 row
    31 vs 34 vs 47 ms; prefill-sized inputs are on par. Packing is a one-off
    reorder at load time and takes no extra memory. It is the kernel
    torch.compile's CPU backend uses, but a private op, so fall back when missing.
    """
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            _onednn_linear(torch.ones(1, 2), _onednn_pack(torch.ones(3, 2)))
            return LinearKernel(_onednn_linear, _onednn_pack)
        except (RuntimeError, AttributeError):
            pass
    return LinearKernel(F.linear, lambda w: w)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new token per row: (B, H, 1, D) queries over (B, K, L, D) keys/values.

    The G = H / K query heads sharing a kv head are the rows of one small matmul,
    so each key and value is read from memory once per step (the CPU kernels of
    scaled_dot_product_attention take ~1.5x longer here: measured 53 vs 34 ms
    per SmolLM2 step at batch 16). bias: (B * K, 1, L), 0 or -inf, or None.
    """
    B, H, _, D = q.shape
    K, L = keys.shape[1], keys.shape[2]
    qg = q.reshape(B * K, H // K, D) * D ** -0.5  # (B * K, G, D): heads h = k * G + g
    kt = keys.reshape(B * K, L, D).transpose(1, 2)  # (B * K, D, L)
    scores = torch.bmm(qg, kt) if bias is None else torch.baddbmm(bias, qg, kt)  # (B * K, G, L)
    out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(B * K, L, D))  # (B * K, G, D)
    return out.view(B, H, 1, D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # torch's own op, bit-identical to the maths below in fp32
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 enable_native_kernels: bool = True) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        # CPU fp32: decode attention (each row's own cache length) and RMSNorm in C (see native.py)
        native = (load_native_kernels() if enable_native_kernels and self.device.type == "cpu"
                  and dtype == torch.float32 else None)
        self.native_decode: DecodeAttention | None = native.decode_attention if native else None
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            native.rms_norm if native else rms_norm)
        kernel = pick_linear(self.device, dtype)
        self.linear, self._pack = kernel.linear, kernel.pack
        self.embed = weights.pop("model.embed_tokens.weight").to(self.device, dtype)  # (V, C)
        lm_head = weights.pop("lm_head.weight", None)
        # A tied head is packed from the embedding, which F.embedding needs plain: with
        # oneDNN that is a copy (V * C * 4 bytes, 113 MB for SmolLM2), bought for speed:
        # the head's matmul at 16 rows took 9.6 ms packed vs 14.4 ms plain (5% of a step).
        # With F.linear, pack is the identity and the two share memory.
        self.lm_head = self._pack(self.embed if lm_head is None else lm_head.to(self.device, dtype))  # (V, C)
        self.norm = weights.pop("model.norm.weight").to(self.device, dtype)  # (C,)
        self.layers = [self._take_layer(weights, i) for i in range(config.num_layers)]
        # computed in fp32, then stored in the model's dtype (as transformers does), so
        # half-precision activations are not promoted to fp32 by the rotation
        cos, sin = rope_tables(config, config.max_position_embeddings, self.device)  # (P, D)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.kv_head_index = torch.arange(config.num_kv_heads, device=self.device)[None, :, None]  # (1, K, 1)

    def _take_layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."

        def take(name: str) -> torch.Tensor:
            return w.pop(p + name).to(self.device, self.dtype)

        qkv = [take(f"self_attn.{n}_proj.weight") for n in "qkv"]
        bias = ([take(f"self_attn.{n}_proj.bias") for n in "qkv"]
                if self.config.attention_bias else None)
        pack = self._pack  # matmul weights in the kernel's layout (opaque: only `linear` reads them)
        return LayerWeights(
            attn_norm=take("input_layernorm.weight"),
            wqkv=pack(torch.cat(qkv, dim=0)),
            bqkv=torch.cat(bias, dim=0) if bias else None,
            wo=pack(take("self_attn.o_proj.weight")),
            mlp_norm=take("post_attention_layernorm.weight"),
            w_gate_up=pack(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")], dim=0)),
            w_down=pack(take("mlp.down_proj.weight")),
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run B rows of T tokens, writing their K/V into the cache.

        Returns float32 logits of the last token of each row (B, V), or of each
        packed prompt (num_prompts, V).
        """
        input_ids, positions, kv_len = batch.input_ids, batch.positions, batch.kv_len
        x = F.embedding(input_ids, self.embed)  # (B, T, C)
        cos = self.cos[positions].unsqueeze(2)  # (B, T, 1, D)
        sin = self.sin[positions].unsqueeze(2)  # (B, T, 1, D)
        # new K/V go to cache[layer, slot, kv head, position]: index tensors broadcast to (B, K, T)
        slots = batch.slot_ids[:, None] if batch.token_slots is None else batch.token_slots  # (B, 1 or T)
        write_index = (slots[:, None, :],  # (B, 1, 1 or T)
                       self.kv_head_index,  # (1, K, 1)
                       positions[:, None, :])  # (B, 1, T)
        mask, key_counts = None, None
        if input_ids.shape[1] == 1 and self.native_decode is not None:
            key_counts = positions[:, 0] + 1  # (B,): the kernel reads keys [0, position] of each row
        elif batch.decode_slot_ids is not None:
            assert self.native_decode is not None, "mixed steps need the native decode kernel"
            key_counts = positions[0, -batch.decode_slot_ids.shape[0]:] + 1  # (num_decodes,)
        elif batch.segment_bounds is None and batch.needs_mask:
            # key j is visible to a query at position p iff j <= p (covers causal + padding)
            key_pos = torch.arange(kv_len, device=self.device)  # (kv_len,)
            mask = (key_pos[None, None, None, :] <= positions[:, None, :, None])  # (B, 1, T, kv_len)
            if input_ids.shape[1] == 1:  # decode: an additive bias per (row, kv head) for decode_attention
                B, K = input_ids.shape[0], self.config.num_kv_heads
                bias = torch.zeros(B, K, 1, kv_len, dtype=self.dtype, device=self.device)
                mask = bias.masked_fill_(~mask, float("-inf")).view(B * K, 1, kv_len)  # (B * K, 1, kv_len)
        for i, layer in enumerate(self.layers):
            h = self.rms_norm(x, layer.attn_norm, self.config.rms_norm_eps)  # (B, T, C)
            x = x + self._attention(h, layer, cache, i, batch, cos, sin, mask, write_index, key_counts)
            h = self.rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)  # (B, T, C)
            x = x + self._mlp(h, layer)
        if batch.segment_bounds is not None:
            last = [b - 1 for b in batch.segment_bounds[1:]]
            num_prefill = batch.segment_bounds[-1]
            x = x[0, last + list(range(num_prefill, input_ids.shape[1]))]  # (num_prompts + num_decodes, C)
        else:
            x = x[:, -1]  # (B, C)
        x = self.rms_norm(x, self.norm, self.config.rms_norm_eps)
        return self.linear(x, self.lm_head).float()  # (B, V)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: KVCache, i: int,
                   batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None, write_index: tuple[torch.Tensor, ...],
                   key_counts: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        B, T, _ = h.shape
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.linear(h, layer.wqkv, layer.bqkv)  # (B, T, (H + 2K) * D)
        qk, v = qkv.split(((H + K) * D, K * D), dim=-1)
        qk = apply_rope(qk.view(B, T, H + K, D), cos, sin)  # (B, T, H + K, D): one rotation for both
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
        k = qk[:, :, H:].transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, K, D).transpose(1, 2)  # (B, K, T, D)
        cache.k[i].index_put_(write_index, k)
        cache.v[i].index_put_(write_index, v)
        kv_len, slots = batch.kv_len, batch.slot_range
        if T == 1 and key_counts is not None:  # CPU fp32 decode (key_counts: the kernel is loaded)
            assert self.native_decode is not None
            out = self.native_decode(qk[:, 0, :H], cache.k[i], cache.v[i], batch.slot_ids,
                                     key_counts)  # (B, H, D)
            return self.linear(out.view(B, 1, H * D), layer.wo)  # (B, 1, C)
        if batch.segment_bounds is not None:  # packed prompt chunks, then any decode tokens
            outs = self._chunk_attention(q, k, v, cache, i, batch)
            if batch.decode_slot_ids is not None:
                assert key_counts is not None and self.native_decode is not None
                decoded = self.native_decode(qk[0, batch.segment_bounds[-1]:, :H], cache.k[i], cache.v[i],
                                             batch.decode_slot_ids, key_counts)  # (num_decodes, H, D)
                outs.append(decoded.transpose(0, 1)[None])  # (1, H, num_decodes, D)
            out = torch.cat(outs, dim=2)  # (1, H, T, D)
        else:
            if slots is not None:
                keys = cache.k[i, slots, :, :kv_len]  # (B, K, kv_len, D) view, no copy
                values = cache.v[i, slots, :, :kv_len]
            else:
                keys = cache.k[i, batch.slot_ids, :, :kv_len]  # (B, K, kv_len, D) gathered copy
                values = cache.v[i, batch.slot_ids, :, :kv_len]
            if T == 1:
                out = decode_attention(q, keys, values, mask)
            else:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=H != K)
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H * D)
        return self.linear(out, layer.wo)  # (B, T, C)

    @staticmethod
    def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, i: int,
                         batch: ForwardBatch) -> list[torch.Tensor]:
        """Per packed chunk: causal attention over its own new tokens and, for a chunk that
        continues a prompt, over the keys its earlier chunks left in the cache."""
        bounds, gqa = batch.segment_bounds, q.shape[1] != k.shape[1]
        assert bounds is not None
        starts = batch.segment_starts or (0,) * (len(bounds) - 1)
        outs = []
        for s, (a, b, start) in enumerate(zip(bounds[:-1], bounds[1:], starts, strict=True)):
            if start == 0:
                outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                           is_causal=True, enable_gqa=gqa))
                continue
            assert batch.segment_slots is not None
            slot, n = batch.segment_slots[s], b - a
            keys = cache.k[i, slot:slot + 1, :, :start + n]  # (1, K, start + n, D): this chunk included
            values = cache.v[i, slot:slot + 1, :, :start + n]
            query_pos = torch.arange(start, start + n, device=q.device)  # (n,)
            mask = torch.arange(start + n, device=q.device)[None, :] <= query_pos[:, None]  # (n, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, a:b], keys, values, attn_mask=mask,
                                                       enable_gqa=gqa))
        return outs

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = self.linear(h, layer.w_gate_up).chunk(2, dim=-1)  # (B, T, F) each
        return self.linear(F.silu(gate) * up, layer.w_down)  # (B, T, C)

