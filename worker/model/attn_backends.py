"""The attention-backend seam (vLLM v1's): the model calls `plan` once per step and, per layer,
`write` (the step's new K/V into the cache) and `forward` (attention of the step's queries).

A backend owns its cache layout (`KVCache.layout`) and the per-step metadata built from the
step's `ForwardBatch`. Three:
- `cpu`: the C kernels (worker/model/native.py) for decode rows, torch SDPA for prompt chunks;
  with LoRA on, every token as a decode row of the C kernel (the fused layers' numerics).
  Layout (K, N, Bs, D).
- `torch`: the reference, and the CUDA path without FlashInfer. Each sequence reads exactly
  the blocks its context needs, and of them exactly [0, context): nothing past a row's end
  (the padding block, slots another request left, which may hold NaN or inf) is ever read,
  so nothing stale can reach a row, and one long row does not make every row pay for it (the
  old decode path gathered every row's blocks up to the longest row). A prompt chunk, a decode
  and a speculative verify are all one query of n tokens over its context. Layout (K, N, Bs, D).
- `flashinfer` (worker/model/flashinfer_backend.py): FlashInfer's paged prefill kernel over
  a block-major (N, K, Bs, D) cache (its HND layout), its decode kernel in CUDA-graph mode for
  static steps (planned by `plan_static`). CUDA only; it has never run here.
Shapes: T new tokens, S sequences, H query heads, K kv heads, D head dim, N blocks of Bs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.attention import KNBD, NKBD, ForwardBatch, KVCache, prefill_attention, rows_as_decodes
from worker.model.native import NativeKernels


@dataclass
class StepPlan:
    """What a backend built once for a step, read by every layer."""

    batch: ForwardBatch
    # where each new K/V goes in a layer's cache: index tensors broadcasting to (T, K)
    write_index: tuple[torch.Tensor, ...]
    extra: Any = None  # the backend's own metadata


class AttentionBackend:
    """The seam. Subclasses set `name` and `cache_layout` and implement `forward`."""

    name = "base"
    cache_layout = KNBD

    def plan(self, batch: ForwardBatch, cache: KVCache, *, all_rows_as_decodes: bool = False) -> StepPlan:
        """The step's metadata, once per step. all_rows_as_decodes: the C kernels' LoRA mode
        (every token attends as a decode row; see LlamaModel.enable_lora)."""
        return StepPlan(batch, write_index(batch, cache))

    def plan_static(self, tables: torch.Tensor, lens: torch.Tensor, cache: KVCache) -> None:
        """Host work of a static step (static_decode.py) before it runs or its CUDA graph replays,
        from its host tables (B, M) and lengths (B,): none for backends that read the buffers."""

    def write(self, cache: KVCache, i: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> None:
        """The step's new keys and values (T, K, D) into layer i's cache."""
        cache.k[i].index_put_(plan.write_index, k.to(cache.dtype))
        cache.v[i].index_put_(plan.write_index, v.to(cache.dtype))

    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                plan: StepPlan) -> torch.Tensor:
        """Attention of the step's queries q (T, H, D) over layer i's cache, written with this
        step's k and v (T, K, D) first -> (T, H, D)."""
        raise NotImplementedError


def write_index(batch: ForwardBatch, cache: KVCache) -> tuple[torch.Tensor, ...]:
    """Index tensors into a layer's cache for the step's slots, in the cache's layout."""
    bs = cache.block_size
    heads = torch.arange(cache.k.shape[1 if cache.layout == KNBD else 2], device=batch.slot_mapping.device)
    block, offset = (batch.slot_mapping // bs)[:, None], (batch.slot_mapping % bs)[:, None]  # (T, 1)
    if cache.layout == KNBD:
        return heads[None, :], block, offset  # (1, K), (T, 1), (T, 1)
    return block, heads[None, :], offset


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def plan(self, batch: ForwardBatch, cache: KVCache, *, all_rows_as_decodes: bool = False) -> StepPlan:
        """extra: (tables, lens) of the tokens the C kernel runs as decode rows: every token
        with all_rows_as_decodes, else the decodes' (a verify's 1 + k tokens are k + 1 rows)."""
        rows = rows_as_decodes(batch, 0 if all_rows_as_decodes else batch.num_prefills)  # (T', M), (T',)
        return StepPlan(batch, write_index(batch, cache), (all_rows_as_decodes, rows))

    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                plan: StepPlan) -> torch.Tensor:
        every_row, (tables, lens) = plan.extra
        if every_row:  # the step's K/V are all written: prompt rows attend causally too
            return self.kernels.paged_decode_attention(q, cache.k[i], cache.v[i], tables, lens)
        batch = plan.batch
        outs = prefill_attention(q, k, v, cache, i, batch)
        first_decode = batch.query_start_loc[batch.num_prefills]
        if first_decode < q.shape[0]:  # the kernel reads exactly each row's own positions
            q_decodes = q[first_decode:]
            outs.append(self.kernels.paged_decode_attention(q_decodes, cache.k[i], cache.v[i], tables, lens))
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, H, D)


@dataclass
class _Span:
    """One sequence of a step: its new tokens [start, stop) and what its context reads."""

    start: int
    stop: int
    context: int
    blocks: torch.Tensor  # (m,) its first ceil(context / Bs) blocks


class TorchBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: ForwardBatch, cache: KVCache, *, all_rows_as_decodes: bool = False) -> StepPlan:
        if batch.is_static:  # shapes fixed by the buffers: see static_decode_attention
            return StepPlan(batch, write_index(batch, cache), None)
        bs, starts = cache.block_size, batch.query_start_loc
        spans = [_Span(a, b, context, batch.block_tables[s, :-(-context // bs)])
                 for s, (a, b, context) in enumerate(zip(starts, starts[1:], batch.context_lens_host,
                                                         strict=False))]
        return StepPlan(batch, write_index(batch, cache), spans)

    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                plan: StepPlan) -> torch.Tensor:
        if plan.extra is None:
            return static_decode_attention(q, cache, i, plan.batch.block_tables, plan.batch.context_lens)
        gqa = q.shape[1] != k.shape[1]
        outs = []
        for span in plan.extra:
            n, context = span.stop - span.start, span.context
            qs = q[None, span.start:span.stop].transpose(1, 2)  # (1, H, n, D); out is the same shape
            if context == n:  # the whole context is new: nothing to read back
                ks = k[None, span.start:span.stop].transpose(1, 2)  # (1, K, n, D)
                vs = v[None, span.start:span.stop].transpose(1, 2)
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=n > 1, enable_gqa=gqa)
            else:
                ks = read_context(cache, cache.k[i], span.blocks, context, q.dtype)  # (1, K, context, D)
                vs = read_context(cache, cache.v[i], span.blocks, context, q.dtype)
                mask = None
                if n > 1:  # query j sits at position context - n + j and sees keys up to it
                    query_pos = torch.arange(context - n, context, device=q.device)  # (n,)
                    mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]  # (n, ctx)
                out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
            outs.append(out[0].transpose(0, 1))  # (n, H, D)
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def static_decode_attention(q: torch.Tensor, cache: KVCache, i: int, tables: torch.Tensor,
                            lens: torch.Tensor) -> torch.Tensor:
    """One query per row over its context, with shapes that do not depend on the step (what a
    CUDA graph can replay): q (B, H, D), tables (B, M), lens (B,) -> (B, H, D). Every row reads
    all M blocks of its table, the price of a fixed shape; what lies past a row's end is zeroed
    and masked (never added to: NaN + -inf is NaN), so no stale value reaches it."""
    B, H, D = q.shape
    if cache.layout == KNBD:  # (K, N, Bs, D) -> (K, B, M, Bs, D)
        K = cache.k.shape[1]
        keys, values = (part[i][:, tables.long()].transpose(0, 1) for part in (cache.k, cache.v))
    else:  # (N, K, Bs, D) -> (B, M, K, Bs, D)
        K = cache.k.shape[2]
        keys, values = (part[i][tables.long()].transpose(1, 2) for part in (cache.k, cache.v))
    keys, values = keys.reshape(B, K, -1, D), values.reshape(B, K, -1, D)  # (B, K, M * Bs, D)
    L = keys.shape[2]
    stale = torch.arange(L, device=q.device)[None, :] >= lens[:, None]  # (B, L)
    keys = keys.to(q.dtype).masked_fill(stale[:, None, :, None], 0.0)
    values = values.to(q.dtype).masked_fill(stale[:, None, :, None], 0.0)
    qg = q.view(B, K, H // K, D) * D ** -0.5  # (B, K, G, D): heads h = k * G + g
    scores = qg @ keys.transpose(2, 3)  # (B, K, G, L)
    scores = scores.masked_fill(stale[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).reshape(B, H, D)


def read_context(cache: KVCache, layer: torch.Tensor, blocks: torch.Tensor, context: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """A sequence's first `context` positions, its blocks laid end to end: (1, K, context, D)."""
    if cache.layout == KNBD:  # layer (K, N, Bs, D)
        K, _, bs, D = layer.shape
        rows = layer[:, blocks.long()]  # (K, m, Bs, D)
    else:  # layer (N, K, Bs, D)
        _, K, bs, D = layer.shape
        rows = layer[blocks.long()].transpose(0, 1)  # (K, m, Bs, D)
    return rows.reshape(1, K, -1, D)[:, :, :context].to(dtype)


__all__ = ["NKBD", "AttentionBackend", "CpuBackend", "StepPlan", "TorchBackend"]
