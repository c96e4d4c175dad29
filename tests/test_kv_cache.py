"""Slot bookkeeping: lowest-first allocation, prefix reuse, errors."""

from __future__ import annotations

import pytest

from worker.engine.kv_cache import KVCacheManager


def test_lowest_free_slot_first_and_reuse() -> None:
    kv = KVCacheManager(num_slots=3, max_len=10)
    assert [kv.allocate(r) for r in "abc"] == [(0, 0), (1, 0), (2, 0)]
    assert kv.num_free_slots == 0 and not kv.can_allocate(1)
    kv.free("b")
    kv.free("a")
    assert kv.allocate("d") == (0, 0)  # lowest first keeps the running set packed
    assert kv.slot_of("d") == 0 and kv.slot_of("a") is None


@pytest.mark.parametrize("num_tokens, ok", [(10, True), (11, False)])
def test_can_allocate_respects_max_len(num_tokens: int, ok: bool) -> None:
    assert KVCacheManager(num_slots=1, max_len=10).can_allocate(num_tokens) is ok


SYSTEM = list(range(100, 140))  # a 40-token shared prefix


@pytest.mark.parametrize(("prompt", "expected"), [
    (SYSTEM + [1, 2, 3], (2, 42)),  # the longest match wins: slot 2 holds SYSTEM + [1, 2, 9]
    (SYSTEM + [7], (1, 40)),  # slots 1 and 2 tie at 40: the lower one
    (SYSTEM[:10] + [7], (0, 0)),  # a hit under MIN_PREFIX_HIT: lowest slot, nothing reused
    (SYSTEM + [1, 2, 9], (2, 42)),  # identical: the last token is still computed (its logits)
])
def test_a_free_slot_holding_the_longest_prompt_prefix_is_reused(
        prompt: list[int], expected: tuple[int, int]) -> None:
    kv = KVCacheManager(num_slots=4, max_len=100)
    for r in "abc":
        kv.allocate(r)
    kv.free("b", SYSTEM + [5, 6])  # slot 1
    kv.free("c", SYSTEM + [1, 2, 9])  # slot 2
    kv.free("a", [9] * 50)  # slot 0
    assert kv.allocate("new", prompt) == expected
    assert kv.allocate("next", prompt)[1] < 42  # a slot's cached tokens are gone once it is reused


def test_prefix_caching_can_be_turned_off() -> None:
    kv = KVCacheManager(num_slots=2, max_len=100, enable_prefix_caching=False)
    kv.allocate("a")
    kv.free("a", SYSTEM)
    kv.allocate("b")
    assert kv.allocate("c", SYSTEM + [1]) == (1, 0)


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
