"""BlockPool: which block is handed out, which cached block is evicted, when a hash is a hit."""

from __future__ import annotations

import pytest

from worker.engine.block_pool import NO_PARENT, BlockHasher, BlockPool

HASHER = BlockHasher()
ROOT = HASHER.root(b"")  # the unscoped chain's start


def first_hash(token_ids: tuple[int, ...] | list[int]) -> bytes:
    """The hash of a sequence's first block in the unscoped default."""
    return HASHER.block(ROOT, token_ids)


def make_pool(num_blocks: int = 4, block_size: int = 2) -> BlockPool:
    return BlockPool(num_blocks, block_size)


def cache_new(pool: BlockPool, token_ids: tuple[int, ...], parent: int = NO_PARENT,
              parent_hash: bytes = ROOT) -> int:
    """A newly allocated block holding `token_ids` after `parent`, made findable; still held."""
    (block_id,) = pool.allocate(1)
    assert pool.cache(block_id, HASHER.block(parent_hash, token_ids), token_ids, parent)
    return block_id


def cached_free(pool: BlockPool, *token_ids: tuple[int, ...]) -> list[int]:
    """One cached block per token tuple, each freed right after the previous (oldest first)."""
    ids = []
    for t in token_ids:
        block_id = cache_new(pool, t)
        pool.release([block_id])
        ids.append(block_id)
    return ids


def is_findable(pool: BlockPool, token_ids: tuple[int, ...]) -> bool:
    return pool.lookup(first_hash(token_ids), token_ids, NO_PARENT) is not None


def test_block_hash_depends_on_the_tokens_and_the_parent() -> None:
    assert first_hash([1, 2]) == first_hash((1, 2))
    assert first_hash([1, 2]) != first_hash([2, 1])
    assert first_hash([1, 2]) != HASHER.block(first_hash([0, 0]), [1, 2])


def test_block_hash_depends_on_the_scope_root() -> None:
    roots = {HASHER.root(scope) for scope in (b"", b"a", b"b", b"ab")}
    assert len(roots) == 4
    assert len({HASHER.block(root, (1, 2)) for root in roots}) == 4
    assert HASHER.root(b"a") == HASHER.root(b"a")


def test_block_hashes_are_keyed_not_pythons_hash() -> None:
    """Two hashers (two KV managers, two processes) draw different keys: nobody outside the
    process can compute a block's hash, so nobody can craft a prompt that takes its slot."""
    other = BlockHasher()
    assert other.root(b"") != ROOT
    assert other.block(ROOT, (1, 2)) != first_hash((1, 2))
    assert len(first_hash((1, 2))) == 16 and isinstance(first_hash((1, 2)), bytes)
    same_key = b"k" * 32
    assert BlockHasher(same_key).block(b"", (1, 2)) == BlockHasher(same_key).block(b"", (1, 2))


def test_lookup_verifies_the_scope() -> None:
    """Even under the same hash and tokens, a block computed in one scope is no hit in another."""
    pool = make_pool()
    (block_id,) = pool.allocate(1)
    assert pool.cache(block_id, first_hash((1, 2)), (1, 2), NO_PARENT, b"tenant-a")
    found = pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT, b"tenant-a")
    assert found is not None and found.block_id == block_id
    assert pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT, b"tenant-b") is None
    assert pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT) is None
    pool.release([block_id])
    pool.allocate(4)  # evicts it: the next holder's block starts unscoped
    assert pool.blocks[block_id].scope == b""
    pool.check()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 1)])
def test_sizes_below_one_are_refused(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_a_new_pool_hands_out_every_block_once_lowest_id_first() -> None:
    pool = make_pool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (0, 4)
    assert all(b.ref_count == 1 for b in pool.blocks)
    pool.check()


def test_allocation_prefers_empty_blocks_over_cached_ones() -> None:
    pool = make_pool(4)
    a, b = cached_free(pool, (1, 1), (2, 2))
    assert pool.num_free_blocks == 4
    got = pool.allocate(2)
    assert a not in got and b not in got
    assert is_findable(pool, (1, 1)) and is_findable(pool, (2, 2))
    assert pool.allocate(1) == [a]  # no empty block left: the cached one freed first goes
    assert not is_findable(pool, (1, 1)) and is_findable(pool, (2, 2))
    assert pool.blocks[a].block_hash is None and pool.blocks[a].token_ids == ()
    pool.check()


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = make_pool(3)
    a, b, c = cached_free(pool, (1, 1), (2, 2), (3, 3))
    pool.acquire(a)  # a hit: a is used again, then freed last
    pool.release([a])
    assert [pool.allocate(1)[0] for _ in range(3)] == [b, c, a]
    assert not any(is_findable(pool, t) for t in [(1, 1), (2, 2), (3, 3)])
    pool.check()


def test_released_table_tails_are_evicted_before_shared_heads() -> None:
    pool = make_pool(6)
    head = cache_new(pool, (1, 1))
    parent = pool.blocks[head].content_id
    head_hash = first_hash((1, 1))
    tail_a = cache_new(pool, (2, 2), parent, head_hash)
    pool.acquire(head)  # a second request shares the head
    tail_b = cache_new(pool, (3, 3), parent, head_hash)
    pool.release([tail_a, head])  # each table released tail first
    pool.release([tail_b, head])
    pool.allocate(3)  # the empty blocks
    assert [pool.allocate(1)[0] for _ in range(3)] == [tail_a, tail_b, head]


@pytest.mark.parametrize(("tokens", "parent", "is_hit"), [
    ((1, 2), NO_PARENT, True),
    ((1, 3), NO_PARENT, False),  # same hash, other tokens: a collision
    ((1, 2), 12345, False),  # same hash and tokens, after another parent's content
])
def test_lookup_verifies_tokens_and_parent_content(tokens: tuple[int, ...], parent: int,
                                                   is_hit: bool) -> None:
    pool = make_pool()
    block_id = cache_new(pool, (1, 2))
    found = pool.lookup(first_hash((1, 2)), tokens, parent)
    assert (found.block_id if found else None) == (block_id if is_hit else None)


def test_a_forced_hash_collision_is_never_a_hit() -> None:
    pool = make_pool()
    other_hash = first_hash((7, 7))
    (block_id,) = pool.allocate(1)
    assert pool.cache(block_id, other_hash, (1, 2), NO_PARENT)  # (1, 2) stored under (7, 7)'s hash
    assert pool.lookup(other_hash, (7, 7), NO_PARENT) is None
    assert pool.lookup(other_hash, (1, 2), NO_PARENT).block_id == block_id  # type: ignore[union-attr]
    assert pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT) is None  # not under its own


def test_lookup_of_an_unknown_hash_is_none() -> None:
    pool = make_pool()
    assert pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT) is None


def test_a_second_block_with_a_cached_hash_stays_private() -> None:
    pool = make_pool()
    first = cache_new(pool, (1, 2))
    (twin,) = pool.allocate(1)
    assert not pool.cache(twin, first_hash((1, 2)), (1, 2), NO_PARENT)
    assert pool.blocks[twin].block_hash is None
    pool.release([twin])
    assert pool.num_free_blocks == 3 and not pool.is_cached_free(twin)  # freed as an empty block
    assert pool.lookup(first_hash((1, 2)), (1, 2), NO_PARENT).block_id == first  # type: ignore[union-attr]
    pool.check()


def test_each_caching_gives_new_content_id() -> None:
    pool = make_pool(2)
    (a,) = cached_free(pool, (1, 1))
    old = pool.blocks[a].content_id
    pool.allocate(2)  # evicts a
    pool.release([a])
    assert pool.cache(pool.allocate(1)[0], first_hash((1, 1)), (1, 1), NO_PARENT)
    assert pool.blocks[a].content_id != old


def test_acquire_of_a_free_cached_block_takes_it_off_the_free_list() -> None:
    pool = make_pool(3)
    (a,) = cached_free(pool, (1, 1))
    assert pool.is_cached_free(a) and pool.num_free_blocks == 3
    pool.acquire(a)
    assert not pool.is_cached_free(a)
    assert (pool.num_free_blocks, pool.blocks[a].ref_count) == (2, 1)
    assert a not in pool.allocate(2)  # it can no longer be evicted
    assert is_findable(pool, (1, 1))
    pool.check()


def test_acquire_of_a_held_block_adds_a_reference() -> None:
    pool = make_pool()
    a = cache_new(pool, (1, 1))
    pool.acquire(a)
    pool.release([a])
    assert pool.blocks[a].ref_count == 1 and pool.num_free_blocks == 3
    pool.release([a])
    assert pool.is_cached_free(a)


def test_over_release_raises() -> None:
    pool = make_pool()
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(ValueError):
        pool.release([a])
    with pytest.raises(ValueError):
        pool.release([3])  # never allocated
    pool.check()


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    pool = make_pool(4)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    pool.check()


def test_caching_twice_or_caching_a_free_block_raises() -> None:
    pool = make_pool()
    a = cache_new(pool, (1, 1))
    with pytest.raises(ValueError):
        pool.cache(a, first_hash((2, 2)), (2, 2), NO_PARENT)
    with pytest.raises(ValueError):
        pool.cache(3, first_hash((3, 3)), (3, 3), NO_PARENT)  # nobody holds block 3
    assert not is_findable(pool, (2, 2)) and not is_findable(pool, (3, 3))
    pool.check()
