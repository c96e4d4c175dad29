"""The torch attention path (worker/model/attention.py), which CUDA workers run."""

from __future__ import annotations

import torch

from worker.model.attention import ForwardBatch, KVCache, decode_bias, torch_decode_attention
from worker.model.config import ModelConfig

BLOCK = 4


def make_config(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(vocab_size=16, hidden_size=num_heads * head_dim, intermediate_size=8, num_layers=1,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def decode_step(tables: list[list[int]], lens: list[int]) -> ForwardBatch:
    """One decode row per table (padded with block 0, as the batch builder pads), lens[b] its
    context length."""
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # (B, M)
    zeros = torch.zeros(len(lens), dtype=torch.int64)  # (B,)
    return ForwardBatch(input_ids=zeros, positions=torch.tensor(lens) - 1, slot_mapping=zeros,
                        block_tables=padded, context_lens=torch.tensor(lens, dtype=torch.int32),
                        query_start_loc=tuple(range(len(lens) + 1)), context_lens_host=tuple(lens),
                        num_prefills=0, logits_indices=torch.arange(len(lens)))


def reference(q: torch.Tensor, cache: KVCache, table: list[int], n: int, num_kv_heads: int) -> torch.Tensor:
    """Row attention over exactly its n positions, read block by block: q (H, D) -> (H, D)."""
    k = torch.cat([cache.k[0][:, b] for b in table], dim=1)[:, :n]  # (K, n, D)
    v = torch.cat([cache.v[0][:, b] for b in table], dim=1)[:, :n]
    G = q.shape[0] // num_kv_heads
    k, v = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)  # (H, n, D)
    weights = torch.softmax((q[:, None] @ k.transpose(1, 2))[:, 0] * q.shape[-1] ** -0.5, dim=-1)  # (H, n)
    return (weights[:, None] @ v)[:, 0]


def test_a_poisoned_padding_block_or_stale_slot_changes_no_rows_output() -> None:
    g = torch.Generator().manual_seed(0)
    config = make_config()
    cpu = torch.device("cpu")
    cache = KVCache(config, num_blocks=6, block_size=BLOCK, dtype=torch.float32, device=cpu)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    tables, lens = [[1, 2], [3], [5, 4]], [6, 3, 5]
    batch = decode_step(tables, lens)
    q = torch.randn(3, config.num_heads, config.head_dim, generator=g)  # (B, H, D)
    want = torch.stack([reference(q[b], cache, tables[b], lens[b], config.num_kv_heads) for b in range(3)])
    for poison in (float("nan"), float("inf"), float("-inf")):
        poisoned = KVCache(config, num_blocks=6, block_size=BLOCK, dtype=torch.float32, device=cpu)
        poisoned.k.copy_(cache.k)
        poisoned.v.copy_(cache.v)
        for part in (poisoned.k, poisoned.v):
            part[0, :, 0] = poison  # the padding block
            part[0, :, 2, 2:] = poison  # row 0's block past its end (len 6 = 4 + 2)
            part[0, :, 3, 3] = poison  # row 1's last slot (len 3)
            part[0, :, 4, 1:] = poison  # row 2's (len 5 = 4 + 1)
        bias = decode_bias(batch, BLOCK, config.num_kv_heads, torch.float32)
        assert bias is not None
        got = torch_decode_attention(q, poisoned, 0, batch, bias)  # (B, H, D)
        assert torch.isfinite(got).all(), f"{poison} leaked into a row"
        torch.testing.assert_close(got, want)
