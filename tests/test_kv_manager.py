"""KVCacheManager, case by case: block tables, prefix hits, the reserve, eviction, and the
scheduler's flow (admit, prefill, decode, finish, preempt). The random sequences of the
same operations are in test_kv_manager_machine.py."""

from __future__ import annotations

import pytest

from tests.kv_factories import make_manager, num_cached_blocks, num_used, prefill, snapshot, tokens
from worker.engine.kv_manager import KVCacheManager

# -- the product's case: one system prompt, many questions -------------------------------------------


def test_one_system_prompt_for_32_requests_is_stored_once() -> None:
    kv = make_manager(num_blocks=128, block_size=16)
    system = tokens(400, seed=0)
    prompts = [system + tokens(30, seed=i + 1) for i in range(32)]
    running: list[str] = []

    # Step 1: the first request is admitted and prefilled; the others wait for its prefix.
    assert kv.allocate("r0", prompts[0], num_reserved=len(running)) == 0
    running.append("r0")
    assert all(kv.is_prefix_pending(p) for p in prompts[1:])
    kv.commit("r0", 430, prompts[0])

    # Step 2: r0 decodes its first token, then the others are admitted on top of the cached prefix.
    assert kv.grow("r0", 431)
    for i in range(1, 32):
        assert not kv.is_prefix_pending(prompts[i])
        assert kv.allocate(f"r{i}", prompts[i], num_reserved=len(running)) == 400
        running.append(f"r{i}")

    num_tail = kv.blocks_for(430) - 25
    assert num_tail == 2
    assert num_used(kv) == 25 + 32 * num_tail
    assert kv.usage == pytest.approx((25 + 32 * num_tail) / 128)
    assert kv.num_prefix_hit_tokens == 31 * 400
    assert kv.num_prefix_query_tokens == 32 * 430
    shared = kv.block_table("r0")[:25]
    assert all(kv.block_table(r)[:25] == shared for r in running)
    kv.check()


def test_a_prompt_prefilled_in_chunks_becomes_a_hit_chunk_by_chunk() -> None:
    kv = make_manager(num_blocks=64, block_size=4)
    prompt = tokens(40, seed=1)
    other = prompt[:32] + tokens(8, seed=2)
    kv.allocate("a", prompt)
    assert kv.is_prefix_pending(other)
    kv.commit("a", 16, prompt)
    assert kv.is_prefix_pending(other)  # its block 4 is in a's next chunk
    kv.commit("a", 32, prompt)
    assert not kv.is_prefix_pending(other)  # its block 8 is its own
    assert kv.allocate("b", other) == 32


def test_a_prefix_computed_by_two_requests_at_once_is_cached_once() -> None:
    kv = make_manager(num_blocks=16, block_size=4)
    prompt = tokens(9, seed=1)
    assert kv.allocate("a", prompt) == 0
    assert kv.allocate("b", prompt) == 0  # admitted in the same step: nothing to share yet
    kv.commit("a", 9, prompt)
    kv.commit("b", 9, prompt)
    kv.check()
    assert kv.allocate("c", prompt + [5]) == 8
    assert kv.block_table("c")[:2] == kv.block_table("a")[:2]
    for r in "abc":
        kv.free(r)
    assert kv.num_free_blocks == 16 and num_cached_blocks(kv) == 2
    kv.check()


# -- finished and preempted requests -----------------------------------------------------------------


@pytest.mark.parametrize("num_prompt", [12, 13, 15])
def test_a_finished_request_leaves_its_full_blocks_cached(num_prompt: int) -> None:
    kv = make_manager(num_blocks=16, block_size=4)
    prompt = tokens(num_prompt, seed=1)
    prefill(kv, "a", prompt)
    kv.free("a")
    assert kv.num_free_blocks == 16 and num_cached_blocks(kv) == num_prompt // 4
    assert kv.allocate("longer", prompt + tokens(5, seed=2)) == num_prompt // 4 * 4
    kv.free("longer")
    # The same prompt again: its last token is always computed (its logits give the first token).
    assert kv.allocate("same", prompt) == (num_prompt - 1) // 4 * 4
    kv.check()


def test_a_preempted_request_recomputes_mostly_from_the_cache() -> None:
    kv = make_manager(num_blocks=16, block_size=4)
    prompt, output = tokens(6, seed=1), [1]  # the first token is sampled at the end of prefill
    prefill(kv, "r", prompt)
    for token in range(2, 8):  # decode: room for the last sampled token, compute it, sample the next
        num_tokens = len(prompt) + len(output)
        assert kv.grow("r", num_tokens)
        kv.commit("r", num_tokens, prompt, output)
        output.append(token)
    kv.free("r")  # preempted with 13 tokens, 12 of them computed
    assert kv.allocate("r", prompt + output) == 12
    kv.check()


def test_free_twice_releases_once() -> None:
    kv = make_manager(num_blocks=8, block_size=4)
    kv.allocate("a", tokens(9))
    kv.free("a")
    kv.free("a")
    assert kv.num_free_blocks == 8 and not kv.has("a")
    kv.check()


def test_allocate_refuses_a_second_table_or_no_tokens() -> None:
    kv = make_manager(num_blocks=8, block_size=4)
    kv.allocate("a", tokens(5))
    with pytest.raises(ValueError):
        kv.allocate("a", tokens(5))
    with pytest.raises(ValueError):
        kv.allocate("b", [])
    assert num_used(kv) == 2
    kv.check()


# -- limits --------------------------------------------------------------------------------------------


def test_allocation_leaves_num_reserved_blocks_free() -> None:
    kv = make_manager(num_blocks=10, block_size=4)
    ids = tokens(12)  # 3 blocks
    before = snapshot(kv)
    assert kv.allocate("a", ids, num_reserved=8) is None
    assert snapshot(kv) == before and not kv.has("a")
    assert kv.allocate("a", ids, num_reserved=7) == 0
    assert kv.num_free_blocks == 7


def test_free_cached_hits_count_against_the_reserve() -> None:
    kv = make_manager(num_blocks=10, block_size=4)
    prompt = tokens(9, seed=1)  # 2 full blocks, cached once freed
    prefill(kv, "a", prompt)
    kv.free("a")
    ids = prompt + [1, 2, 3]  # 2 free cached hits + 1 new block leave the free list
    before = snapshot(kv)
    assert kv.allocate("b", ids, num_reserved=8) is None
    assert snapshot(kv) == before and not kv.has("b")
    assert kv.allocate("b", ids, num_reserved=7) == 8
    assert kv.num_free_blocks == 7


def test_hits_on_held_blocks_do_not_count_against_the_reserve() -> None:
    kv = make_manager(num_blocks=6, block_size=4)
    prompt = tokens(9, seed=1)
    prefill(kv, "a", prompt)  # holds 3 blocks, 2 of them cached
    ids = prompt[:8] + [1, 2, 3, 4]  # 2 hits on a's blocks + 1 new
    assert kv.allocate("b", ids, num_reserved=3) is None
    assert kv.allocate("b", ids, num_reserved=2) == 8
    assert kv.num_free_blocks == 2


def test_grow_out_of_blocks_returns_false_and_changes_nothing() -> None:
    kv = make_manager(num_blocks=4, block_size=4)
    kv.allocate("a", tokens(14))  # the whole pool
    table = list(kv.block_table("a"))
    assert kv.grow("a", 16) and kv.grow("a", 3)  # still within its blocks
    before = snapshot(kv)
    assert not kv.grow("a", 17)
    assert kv.block_table("a") == table and snapshot(kv) == before
    kv.check()


def test_grow_takes_empty_blocks_then_evicts_cached_ones() -> None:
    kv = make_manager(num_blocks=3, block_size=4)
    old = tokens(5, seed=1)
    prefill(kv, "old", old)
    kv.free("old")  # 1 cached block, 2 empty
    kv.allocate("a", tokens(4, seed=2))
    assert kv.grow("a", 5)
    assert num_cached_blocks(kv) == 1  # an empty block was taken
    assert kv.grow("a", 9)  # only the cached block is left: evicted
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 0 and num_cached_blocks(kv) == 0
    assert not kv.grow("a", 13)
    kv.free("a")
    assert kv.allocate("probe", old) == 0
    kv.check()


def test_without_prefix_caching_nothing_is_cached_or_hit() -> None:
    kv = make_manager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prompt = tokens(13, seed=1)
    assert kv.allocate("a", prompt) == 0
    assert not kv.is_prefix_pending(prompt)
    kv.commit("a", 13, prompt)
    assert kv.allocate("b", prompt) == 0
    assert num_used(kv) == 8  # two copies
    kv.free("a")
    kv.free("b")
    assert num_cached_blocks(kv) == 0 and not any(kv.pool.is_cached_free(i) for i in range(16))
    assert kv.allocate("c", prompt + [1]) == 0
    assert kv.num_prefix_hit_tokens == 0 and kv.num_prefix_query_tokens == 13 + 13 + 14
    kv.check()


# -- a request that computes a copy of a prefix another request cached ---------------------------------


def orphan_a_cached_block(kv: KVCacheManager, p0: list[int], q1: list[int]) -> None:
    """Leave b's block 1 (tokens q1 after p0) cached, chained to a copy of p0 that is evicted.

    a and b are admitted in the same step with the same first block: b's copy of it stays
    private and b's chain goes on through a's block. Then a finishes and its blocks are evicted.
    """
    a_ids, b_ids = p0 + [9] * len(p0), p0 + q1 + [0]
    kv.allocate("a", a_ids)
    kv.allocate("b", b_ids)
    kv.commit("a", len(a_ids), a_ids)
    kv.commit("b", len(b_ids), b_ids)
    kv.free("a")
    filler = [1_000 + i for i in range(kv.num_free_blocks * kv.block_size)]
    assert kv.allocate("filler", filler) == 0  # evicts every free cached block: a's
    kv.free("filler")


def test_a_cached_block_stays_findable_after_the_copy_its_chain_went_through_is_evicted() -> None:
    kv = make_manager(num_blocks=12, block_size=2)
    p0, q1 = [1, 2], [3, 4]
    orphan_a_cached_block(kv, p0, q1)  # b still holds its block 1 (p0 + q1), cached
    c_ids = p0 + q1 + [6]
    prefill(kv, "c", c_ids)  # c caches p0 anew
    # p0 and p0 + q1 are both cached and held, so a request with that prefix must hit both.
    assert kv.allocate("d", p0 + q1 + [7]) == 4
    kv.check()


def test_a_prefix_is_not_pending_once_its_request_has_prefilled() -> None:
    kv = make_manager(num_blocks=16, block_size=2)
    p0, q1, r2 = [1, 2], [3, 4], [5, 6]
    orphan_a_cached_block(kv, p0, q1)
    g_ids = p0 + q1 + r2 + [7]
    prefill(kv, "g", g_ids)  # g is prefilled: it will compute none of its prompt blocks again
    kv.free("b")
    filler = [2_000 + i for i in range(kv.num_free_blocks * kv.block_size)]
    kv.allocate("filler", filler)
    kv.free("filler")
    prefill(kv, "h", p0 + q1 + [8])  # p0 + q1 cached again
    # The scheduler holds a waiting prompt back while this is True: here until g finishes.
    assert not kv.is_prefix_pending(p0 + q1 + r2 + [5, 5, 5])
    kv.check()


# -- cache scopes: blocks are shared only between requests of one scope -------------------------------

def test_two_scopes_get_no_cached_tokens_for_each_others_identical_prompt() -> None:
    """One tenant cannot tell from its hit count (or its TTFT) what another has cached."""
    kv = make_manager(num_blocks=32, block_size=4)
    prompt = tokens(21, seed=1)
    prefill(kv, "a", prompt, scope=b"tenant-a")
    assert kv.allocate("b", prompt, scope=b"tenant-b") == 0
    assert kv.allocate("unscoped", prompt) == 0
    assert not set(kv.block_table("b")) & set(kv.block_table("a"))
    kv.check()


def test_requests_of_one_scope_share_its_cached_prefix() -> None:
    kv = make_manager(num_blocks=32, block_size=4)
    system = tokens(16, seed=1)
    prefill(kv, "a1", system + tokens(5, seed=2), scope=b"tenant-a")
    prefill(kv, "b1", system + tokens(5, seed=2), scope=b"tenant-b")
    assert kv.allocate("a2", system + tokens(5, seed=3), scope=b"tenant-a") == 16
    assert kv.block_table("a2")[:4] == kv.block_table("a1")[:4] != kv.block_table("b1")[:4]
    kv.check()


def test_the_same_tokens_hash_differently_in_each_scope() -> None:
    kv = make_manager(num_blocks=32, block_size=4)
    prompt = tokens(17, seed=1)
    hashes = {}
    for scope in (b"", b"tenant-a", b"tenant-b"):
        prefill(kv, scope.decode() or "unscoped", prompt, scope=scope)
        table = kv.block_table(scope.decode() or "unscoped")
        hashes[scope] = {kv.pool.blocks[b].block_hash for b in table[:4]}
        assert len(hashes[scope]) == 4 and None not in hashes[scope]
    assert not hashes[b""] & hashes[b"tenant-a"] and not hashes[b"tenant-a"] & hashes[b"tenant-b"]
    assert not hashes[b""] & hashes[b"tenant-b"]
    kv.check()


def test_each_manager_keys_its_hashes_with_a_key_of_its_own() -> None:
    """Block hashes are BLAKE2b under a random key, not Python's hash: nobody can compute one
    from outside, so nobody can craft a prompt that takes another's hash slot."""
    prompt = tokens(9, seed=1)
    managers = [make_manager(num_blocks=8, block_size=4) for _ in range(2)]
    for kv in managers:
        prefill(kv, "r", prompt)
    first, second = ({kv.pool.blocks[b].block_hash for b in kv.block_table("r")[:2]} for kv in managers)
    assert not first & second
    assert all(isinstance(h, bytes) and len(h) == 16 for h in first)


def test_a_prefix_pending_in_one_scope_holds_back_only_that_scope() -> None:
    kv = make_manager(num_blocks=32, block_size=4)
    prompt = tokens(13, seed=1)
    kv.allocate("a", prompt, scope=b"tenant-a")  # computing its blocks this step
    assert kv.is_prefix_pending(prompt, scope=b"tenant-a")
    assert not kv.is_prefix_pending(prompt, scope=b"tenant-b")
    assert not kv.is_prefix_pending(prompt)
    kv.check()


def test_a_preempted_request_finds_the_blocks_of_its_own_scope() -> None:
    kv = make_manager(num_blocks=16, block_size=4)
    prompt = tokens(13, seed=1)
    prefill(kv, "r", prompt, scope=b"tenant-a")
    kv.free("r")  # preempted: its full blocks stay cached
    assert kv.allocate("other", prompt, scope=b"tenant-b") == 0
    assert kv.allocate("r", prompt, scope=b"tenant-a") == 12
    kv.check()
