"""Small factories for the KV manager's tests (pure Python, no torch)."""

from __future__ import annotations

import random
from typing import Any

from worker.engine.block_pool import BlockHasher
from worker.engine.kv_manager import KVCacheManager


def make_manager(num_blocks: int = 64, block_size: int = 4, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, hasher: BlockHasher | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, max_model_len or num_blocks * block_size,
                          enable_prefix_caching, hasher)


def tokens(n: int, seed: int = 0) -> list[int]:
    """n token ids; different seeds give different sequences."""
    rng = random.Random(seed)
    return [rng.randrange(1_000) for _ in range(n)]


def prefill(kv: KVCacheManager, request_id: str, ids: list[int], num_reserved: int = 0,
            scope: bytes = b"") -> int:
    """Admit and prefill in one step, as the scheduler and `Scheduler.commit` do."""
    num_cached = kv.allocate(request_id, ids, num_reserved, scope=scope)
    assert num_cached is not None
    kv.commit(request_id, len(ids), ids)
    return num_cached


def num_used(kv: KVCacheManager) -> int:
    return kv.num_blocks - kv.num_free_blocks


def num_cached_blocks(kv: KVCacheManager) -> int:
    return sum(b.block_hash is not None for b in kv.pool.blocks)


def snapshot(kv: KVCacheManager) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    pool = kv.pool
    return (kv.num_free_blocks, kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens,
            tuple((b.ref_count, b.block_hash, b.token_ids, b.scope, b.content_id) for b in pool.blocks),
            tuple(pool.is_cached_free(i) for i in range(pool.num_blocks)))
