"""Slot bookkeeping: lowest-first allocation, reuse, errors."""

from __future__ import annotations

import pytest

from worker.kv_cache import KVCacheManager


def test_lowest_free_slot_first_and_reuse() -> None:
    kv = KVCacheManager(num_slots=3, max_len=10)
    assert [kv.allocate(r) for r in "abc"] == [0, 1, 2]
    assert kv.num_free_slots == 0 and not kv.can_allocate(1)
    kv.free("b")
    kv.free("a")
    assert kv.allocate("d") == 0  # lowest first keeps the running set packed
    assert kv.slot_of("d") == 0 and kv.slot_of("a") is None


@pytest.mark.parametrize("num_tokens, ok", [(10, True), (11, False)])
def test_can_allocate_respects_max_len(num_tokens: int, ok: bool) -> None:
    assert KVCacheManager(num_slots=1, max_len=10).can_allocate(num_tokens) is ok


def test_errors() -> None:
    kv = KVCacheManager(num_slots=1, max_len=4)
    kv.allocate("a")
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate("a")
    with pytest.raises(RuntimeError, match="no free"):
        kv.allocate("b")
    kv.free("zzz")  # freeing an unknown id is a no-op
    with pytest.raises(ValueError, match="num_slots"):
        KVCacheManager(num_slots=0, max_len=4)
