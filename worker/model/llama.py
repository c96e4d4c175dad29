"""A Llama-family decoder as plain maths over a paged KV cache.

No I/O, no scheduling: the model runner flattens one step's new tokens (prompt
chunks first, then one token per decoding sequence) and says where each one's
K/V go and which cache blocks each sequence reads (`ForwardBatch`, vLLM's
attention metadata). Two attention paths: a prompt chunk attends causally over
its cached prefix and itself; a decode token attends over its sequence's
cache. Shapes: T new tokens in the step, S sequences, C hidden size, H query
heads, K kv heads, D head dim, N cache blocks of Bs tokens, M blocks per
block table, V vocab.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.linear import Linears, Weight
from worker.model.native import NativeKernels
from worker.model.native_layers import DecodeLayers
from worker.model.quant import QuantWeight, cat_rows
from worker.model.rope import apply_rope, rope_tables


@dataclass
class ForwardBatch:
    """One step's new tokens and where their K/V are read and written.

    Sequence s owns tokens [query_start_loc[s], query_start_loc[s + 1]); the first
    `num_prefills` sequences are prompt chunks, the rest decode one token each. A
    sequence's tokens are the last ones of its context: positions
    [context_lens[s] - n, context_lens[s]).
    """

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,) absolute position of each token
    slot_mapping: torch.Tensor  # (T,) int64: block * Bs + offset, where each new K/V is written
    block_tables: torch.Tensor  # (S, M) int32: each sequence's blocks, padded with block 0
    context_lens: torch.Tensor  # (S,) int32: cached + new tokens each sequence attends over
    query_start_loc: tuple[int, ...]  # (S + 1,) on the host
    context_lens_host: tuple[int, ...]  # (S,) context_lens on the host
    num_prefills: int
    logits_indices: torch.Tensor  # (R,) the tokens whose logits are returned


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


class KVCache:
    """K and V of every layer in blocks, allocated once: each (num_layers, K, N, Bs, D).

    A block holds Bs consecutive positions of one sequence, all kv heads; each
    (kv head, block) is Bs * D contiguous values, and blocks with consecutive ids
    are adjacent, so a prompt's blocks (allocated together) are one contiguous
    stretch per kv head: the decode kernel streams them as it streamed a slot
    per sequence (with (N, K, Bs, D) it read 4 KB pieces 12 KB apart and a
    SmolLM2 batch-16 step's attention took ~20% longer).
    On CPU the memory comes from an anonymous mmap: pages cost RAM only once
    written, so a large budget does not take the memory up front, and
    never-written positions read as finite zeros (the torch decode path reads
    whole blocks and weights the positions past a row's end by 0, so those
    must not be NaN). Its pages are 4 KB, not huge: numpy's zeros (the
    allocator here before) asks for 2 MB pages, so the first block written in
    each (layer, kv head) region took 2 MB, and SmolLM2's first request made
    ~450 MB of a 640-block pool resident; with 4 KB pages it takes the 4 KB of
    each block (one block of one kv head). The attention kernel's extra TLB
    misses are a few thousand per step.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.k = _zeros(shape, dtype, device)  # (L, K, N, Bs, D)
        self.v = _zeros(shape, dtype, device)  # (L, K, N, Bs, D)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * dtype.itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = int(np.prod(shape)) * dtype.itemsize
    buf = mmap.mmap(-1, max(num_bytes, 1))  # anonymous: zero-filled, each page on its first write
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere pages are small anyway
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)[:num_bytes].view(dtype).view(shape)


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
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 kernels: NativeKernels | None = None) -> None:
        """`kernels`: the C kernels (worker/model/native.py) for CPU decode attention,
        RMSNorm and quantized weights, built by the caller; None keeps the torch path
        (CUDA, half precision), which cannot run QuantWeights."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        if kernels is not None and (self.device.type != "cpu" or dtype != torch.float32):
            raise ValueError(f"the C kernels run fp32 on CPU, not {dtype} on {self.device}")
        self.kernels = kernels
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            kernels.rms_norm if kernels is not None else rms_norm)
        self.linear = Linears(self.device, dtype, kernels.quant if kernels is not None else None)
        self.formats = sorted({w.source for w in weights.values() if isinstance(w, QuantWeight)})
        self.embed = self._take(weights, "model.embed_tokens.weight")  # (V, C)
        lm_head = weights.pop("lm_head.weight", None)
        # A tied float head is packed from the embedding, which F.embedding needs plain: with
        # oneDNN that is a copy (V * C * 4 bytes, 113 MB for SmolLM2), bought for speed:
        # the head's matmul at 16 rows took 9.6 ms packed vs 14.4 ms plain (5% of a step).
        # With F.linear, pack is the identity and the two share memory, as a quantized table does.
        head = self.embed if lm_head is None else self._to_device(lm_head)
        self.lm_head = self.linear.prepare(head)  # (V, C)
        self.norm = self._take(weights, "model.norm.weight")  # (C,)
        self.layers = [self._take_layer(weights, i) for i in range(config.num_layers)]
        # computed in fp32, then stored in the model's dtype (as transformers does), so
        # half-precision activations are not promoted to fp32 by the rotation
        cos, sin = rope_tables(config, config.max_position_embeddings, self.device)  # (P, D)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.kv_head_index = torch.arange(config.num_kv_heads, device=self.device)[None, :]  # (1, K)
        self.decode_layers = self._fused_decode_layers()

    def _fused_decode_layers(self) -> DecodeLayers | None:
        """All layers of a step in one C call (kernels/layer.c), where every matmul
        weight is quantized and the shapes are ones the C code takes; else None (per op)."""
        cfg = self.config
        weights = [w for layer in self.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        if (self.kernels is None or not all(isinstance(w, QuantWeight) for w in weights)
                or cfg.head_dim > 512 or (cfg.num_heads * cfg.head_dim) % 32):
            return None
        return self.kernels.decode_layers(self.layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
                                          kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                          ffn=cfg.intermediate_size, eps=cfg.rms_norm_eps, cos=self.cos,
                                          sin=self.sin)

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
        if self.decode_layers is not None:
            tables, lens = self._rows_as_decodes(batch)
            self.decode_layers(x, batch.positions, batch.slot_mapping, tables, lens, cache.k, cache.v)
            return self._logits(x, batch)  # x was updated in place
        cos = self.cos[batch.positions].unsqueeze(1)  # (T, 1, D)
        sin = self.sin[batch.positions].unsqueeze(1)  # (T, 1, D)
        bs = cache.block_size
        # new K/V go to cache[layer, kv head, block, offset]: index tensors broadcast to (T, K)
        write_index = (self.kv_head_index, (batch.slot_mapping // bs)[:, None],  # (1, K), (T, 1)
                       (batch.slot_mapping % bs)[:, None])  # (T, 1)
        decode_bias = self._decode_bias(batch, bs) if self.kernels is None else None
        for i, layer in enumerate(self.layers):
            h = self.rms_norm(x, layer.attn_norm, self.config.rms_norm_eps)  # (T, C)
            x = x + self._attention(h, layer, cache, i, batch, cos, sin, write_index, decode_bias)
            h = self.rms_norm(x, layer.mlp_norm, self.config.rms_norm_eps)  # (T, C)
            x = x + self._mlp(h, layer)
        return self._logits(x, batch)

    @staticmethod
    def _rows_as_decodes(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a decode row of the fused layers: its sequence's block table and
        its own position + 1 as its length, (T, M) int32 and (T,) int32. Its K/V and those of
        the step's earlier tokens of its sequence are written before any row attends, so a
        prompt chunk attends causally, through the same kernel and in the same order as a
        decode would: a token's hidden states do not depend on how its sequence was batched
        or chunked, so a preempted or resumed request recomputes bit for bit what it had.
        It costs prefill speed: SDPA plus, from 64 rows on, dequantized weights in oneDNN
        fp32 ran a 512-token SmolLM2 prefill at 421-458 tok/s, this at 269-285 (2 threads,
        AVX2 EPYC), but the former changed a seeded answer's tokens after a resume.)"""
        if batch.num_prefills == 0:
            return batch.block_tables, batch.context_lens
        starts = batch.query_start_loc
        counts = torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)])  # (S,)
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts)  # (T,) each token's sequence
        return batch.block_tables[rows].contiguous(), (batch.positions + 1).to(torch.int32)

    def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.rms_norm(x[batch.logits_indices], self.norm, self.config.rms_norm_eps)  # (R, C)
        return self.linear(x, self.lm_head).float()  # (R, V)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantWeight):
            assert self.linear.quant is not None
            return self.linear.quant.dequantize_rows(self.embed, ids)  # (T, C)
        return F.embedding(ids, self.embed)  # (T, C)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: KVCache, i: int,
                   batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                   write_index: tuple[torch.Tensor, ...], decode_bias: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        T = h.shape[0]
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.linear(h, layer.wqkv, layer.bqkv)  # (T, (H + 2K) * D)
        qk, v = qkv.split(((H + K) * D, K * D), dim=-1)
        qk = apply_rope(qk.view(T, H + K, D), cos, sin)  # (T, H + K, D): one rotation for both
        q, k = qk[:, :H], qk[:, H:]  # (T, H, D), (T, K, D)
        cache.k[i].index_put_(write_index, k.to(cache.dtype))
        cache.v[i].index_put_(write_index, v.view(T, K, D).to(cache.dtype))
        outs = self._prefill_attention(q, k, v.view(T, K, D), cache, i, batch)
        first_decode = batch.query_start_loc[batch.num_prefills]
        if first_decode < T:
            outs.append(self._decode_attention(q[first_decode:], cache, i, batch, decode_bias))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, H, D)
        return self.linear(out.reshape(T, H * D), layer.wo, layer.bo)  # (T, C)

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                           i: int, batch: ForwardBatch) -> list[torch.Tensor]:
        """Per prompt chunk: causal attention over its own new tokens and, when it continues
        a prompt (chunked prefill, prefix hit), over the keys already in its blocks.

        The inputs are 4-D with a batch of 1 on purpose: torch's CPU SDPA takes its fused
        kernel only for 4-D inputs and falls back to the unfused maths for 3-D ones, 4x
        slower at 512 tokens (measured 31 vs 7.8 ms per layer, SmolLM2 shapes)."""
        outs, gqa, bs = [], q.shape[1] != k.shape[1], cache.block_size
        for s in range(batch.num_prefills):
            a, b = batch.query_start_loc[s], batch.query_start_loc[s + 1]
            n, context = b - a, batch.context_lens_host[s]
            qs = q[None, a:b].transpose(1, 2)  # (1, H, n, D); out is the same shape
            if context == n:  # the whole context is new: nothing to read back
                ks, vs = k[None, a:b].transpose(1, 2), v[None, a:b].transpose(1, 2)  # (1, K, n, D)
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                blocks = batch.block_tables[s:s + 1, :-(-context // bs)]  # (1, m)
                keys = _gather_blocks(cache.k[i], blocks, q.dtype)[:, :, :context]  # (1, K, context, D)
                values = _gather_blocks(cache.v[i], blocks, q.dtype)[:, :, :context]
                query_pos = torch.arange(context - n, context, device=q.device)  # (n,)
                mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]  # (n, context)
                out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=gqa)
            outs.append(out[0].transpose(0, 1))  # (n, H, D)
        return outs

    def _decode_attention(self, q: torch.Tensor, cache: KVCache, i: int, batch: ForwardBatch,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """One token per sequence over its whole context: q (B, H, D) -> (B, H, D)."""
        p = batch.num_prefills
        tables, lens = batch.block_tables[p:], batch.context_lens[p:]  # (B, M), (B,)
        if self.kernels is not None:  # reads exactly each row's own positions through its table
            return self.kernels.paged_decode_attention(q, cache.k[i], cache.v[i], tables, lens)
        assert bias is not None, "the torch decode path needs its bias (_decode_bias)"
        m = bias.shape[-1] // cache.block_size
        keys = _gather_blocks(cache.k[i], tables[:, :m], q.dtype)  # (B, K, m * Bs, D)
        values = _gather_blocks(cache.v[i], tables[:, :m], q.dtype)
        return decode_attention(q[:, :, None], keys, values, bias)[:, :, 0]  # (B, H, D)

    def _decode_bias(self, batch: ForwardBatch, block_size: int) -> torch.Tensor | None:
        """For the torch decode path: 0 for each row's positions, -inf past its end:
        (B * K, 1, m * Bs), m the longest row's block count. None without decodes."""
        lens = batch.context_lens[batch.num_prefills:]  # (B,)
        if lens.shape[0] == 0:
            return None
        m = -(-max(batch.context_lens_host[batch.num_prefills:]) // block_size)
        key_pos = torch.arange(m * block_size, device=lens.device)  # (m * Bs,)
        bias = torch.zeros(lens.shape[0], m * block_size, dtype=self.dtype, device=lens.device)
        bias.masked_fill_(key_pos[None, :] >= lens[:, None], float("-inf"))  # (B, m * Bs)
        K = self.config.num_kv_heads
        bias = bias[:, None, None, :].expand(-1, K, 1, -1)  # (B, K, 1, m * Bs)
        return bias.reshape(-1, 1, m * block_size)  # (B * K, 1, m * Bs)

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return self.linear(self.linear.gate_up(h, layer.w_gate_up), layer.w_down)  # (T, F) -> (T, C)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of each row laid end to end: cache (K, N, Bs, D), tables (B, m) -> (B, K, m * Bs, D)."""
    B, m = tables.shape
    K, _, bs, D = cache.shape
    blocks = cache[:, tables.long()]  # (K, B, m, Bs, D) gathered copy
    return blocks.transpose(0, 1).reshape(B, K, m * bs, D).to(dtype)
