"""The paged KV cache, a step's attention metadata (`ForwardBatch`) and attention over them in torch.

The attention backends (worker/model/attn_backends.py) run attention over them. Shapes: T new
tokens in the step, S sequences, H query heads, K kv heads, D head dim, N cache blocks of Bs
tokens, M blocks per block table.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.model.config import ModelConfig
from worker.model.lora import LoraAdapter


@dataclass
class ForwardBatch:
    """One step's new tokens and where their K/V are read and written.

    Sequence s computes tokens [query_start_loc[s], query_start_loc[s + 1]) this step
    (vLLM v1's num_scheduled_tokens); the first `num_prefills` sequences are prompt chunks,
    the rest decodes: each its last token and the k proposals it verifies, one query of
    1 + k tokens over its context. A sequence's tokens are the last ones of its context:
    positions [context_lens[s] - n, context_lens[s]).
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
    # LoRA (a model with enable_lora): each token's index into `adapters`, -1 for the base model;
    # None when no token has an adapter
    lora_slots: torch.Tensor | None = None  # (T,) int64
    adapters: tuple[LoraAdapter, ...] = ()
    # A static step (worker/model/static_decode.py: decode rows only, in buffers a CUDA graph
    # replays): query_start_loc and context_lens_host describe the capture, not this step, so
    # attention must read the device tensors only
    is_static: bool = False
    # block_tables on the host when the step was built there (BatchBuilder, InputBatch): a backend
    # that plans on the host (FlashInfer) reads it instead of copying the device's back, which
    # would wait for the GPU every step
    block_tables_host: torch.Tensor | None = None  # (S, M) int32



KNBD = "KNBD"  # each layer's K (and V): (K, N, Bs, D), the C kernels' and torch's layout
NKBD = "NKBD"  # block-major, (N, K, Bs, D): FlashInfer's HND


class KVCache:
    """K and V of every layer in blocks, allocated once: each (num_layers, K, N, Bs, D), or
    (num_layers, N, K, Bs, D) in the block-major layout an attention backend may ask for
    (worker/model/attn_backends.py: the backend owns the layout).

    A block holds Bs consecutive positions of one sequence, all kv heads; each
    (kv head, block) is Bs * D contiguous values, and blocks with consecutive ids
    are adjacent, so a prompt's blocks (allocated together) are one contiguous
    stretch per kv head: the decode kernel streams them as it streamed a slot
    per sequence (with (N, K, Bs, D) it read 4 KB pieces 12 KB apart and a
    SmolLM2 batch-16 step's attention took ~20% longer).
    On CPU the memory comes from an anonymous mmap: pages cost RAM only once
    written, so a large budget does not take the memory up front (whatever a
    never-written or stale slot holds, no backend reads it for a row: each reads
    exactly [0, len) of a row's own blocks).
    Its pages are 4 KB, not huge: numpy's zeros (the allocator here before)
    asks for 2 MB pages, so the first block written in each (layer, kv head)
    region took 2 MB, and SmolLM2's first request made
    ~450 MB of a 640-block pool resident; with 4 KB pages it takes the 4 KB of
    each block (one block of one kv head). The attention kernel's extra TLB
    misses are a few thousand per step.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layout: str = KNBD) -> None:
        if layout not in (KNBD, NKBD):
            raise ValueError(f"KV cache layout must be {KNBD} or {NKBD}, got {layout!r}")
        K, N = config.num_kv_heads, num_blocks
        shape = (config.num_layers, *((K, N) if layout == KNBD else (N, K)), block_size, config.head_dim)
        self.k = _zeros(shape, dtype, device)  # (L, K, N, Bs, D) or (L, N, K, Bs, D)
        self.v = _zeros(shape, dtype, device)
        self.layout = layout
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



def rows_as_decodes(batch: ForwardBatch, first_seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every new token (of the sequences from first_seq on) as a decode row of the C kernels:
    its sequence's block table and its own position + 1 as its length, (T', M) int32 and (T',)
    int32. A verified proposal is such a row too, so speculation computes exactly what plain
    decoding computes. Its K/V and those of
    the step's earlier tokens of its sequence are written before any row attends, so a
    prompt chunk attends causally, through the same kernel and in the same order as a
    decode would: a token's hidden states do not depend on how its sequence was batched
    or chunked, so a preempted or resumed request recomputes bit for bit what it had.
    It costs prefill speed: SDPA plus, from 64 rows on, dequantized weights in oneDNN
    fp32 ran a 512-token SmolLM2 prefill at 421-458 tok/s, this at 269-285 (2 threads,
    AVX2 EPYC), but the former changed a seeded answer's tokens after a resume.)"""
    starts = batch.query_start_loc[first_seq:]
    counts = [b - a for a, b in zip(starts, starts[1:], strict=False)]  # (S',) on the host
    if all(n == 1 for n in counts):  # one token a sequence: its context is its length
        return batch.block_tables[first_seq:], batch.context_lens[first_seq:]
    rows = torch.repeat_interleave(torch.arange(first_seq, first_seq + len(counts)),
                                   torch.tensor(counts)).to(batch.block_tables.device)  # (T',) its sequence
    return (batch.block_tables[rows].contiguous(),
            (batch.positions[starts[0]:] + 1).to(torch.int32))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, i: int,
                      batch: ForwardBatch) -> list[torch.Tensor]:
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
            keys = gather_blocks(cache.k[i], blocks, q.dtype)[:, :, :context]  # (1, K, context, D)
            values = gather_blocks(cache.v[i], blocks, q.dtype)[:, :, :context]
            query_pos = torch.arange(context - n, context, device=q.device)  # (n,)
            mask = torch.arange(context, device=q.device)[None, :] <= query_pos[:, None]  # (n, context)
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))  # (n, H, D)
    return outs


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of each row laid end to end: cache (K, N, Bs, D), tables (B, m) -> (B, K, m * Bs, D)."""
    B, m = tables.shape
    K, _, bs, D = cache.shape
    blocks = cache[:, tables.long()]  # (K, B, m, Bs, D) gathered copy
    return blocks.transpose(0, 1).reshape(B, K, m * bs, D).to(dtype)
