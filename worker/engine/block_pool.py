"""Physical KV-cache blocks: reference counts, prefix hashes, LRU eviction (no torch).

The cache tensors (worker/model/llama.py `KVCache`) hold `num_blocks` blocks of
`block_size` tokens each; this pool only hands out block ids. A block is either

- used: ref_count > 0, held by one or more running requests (a shared prefix
  is one physical block in several block tables);
- free and empty: ref_count == 0, no hash; handed out first;
- free and cached: ref_count == 0 but it still holds the K/V of a full block
  that a request computed; it stays findable by its hash and is evicted, least
  recently freed first, only when no empty block is left.

A full block is known by a chained hash of (parent block's hash, its token ids),
starting from its cache scope's root (`BlockHasher`), so equal hashes mean equal
scopes and prefixes except on a hash collision. A lookup therefore also compares
the tokens, the scope and the identity of the parent block's content
(`content_id`, new each time a block is cached): by induction over the chain, a
hit is exactly the same scope and token prefix, never a colliding one.

The hashes are keyed (BLAKE2b under a random key drawn when the pool's manager
is built) so that nobody outside the process can compute one: with a public hash
(Python's `hash`), a prompt crafted to collide with another caller's block would
take its hash slot first (`cache` keeps the first block of a hash), and that
caller would lose its cache hit. Scopes keep callers apart: a request only ever
finds blocks computed under its own scope (the gateway's `cache_scope`, b"" by
default), so hit counts and first-token times tell nobody what another scope
has cached.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NO_PARENT = -1  # content id "before" the first block of a sequence
HASH_BYTES = 16  # 128-bit digests: a collision is never expected, only tolerated (see lookup)
KEY_BYTES = 32


class BlockHasher:
    """Chained block hashes: BLAKE2b-128 keyed with `key` (random by default, so unknown outside
    the process), one personalisation for scope roots and another for blocks, so a root can never
    equal a block's hash."""

    def __init__(self, key: bytes | None = None) -> None:
        key = secrets.token_bytes(KEY_BYTES) if key is None else key
        # Keyed states prepared once: copying one skips the compression of the key block per hash.
        self._root = hashlib.blake2b(key=key, digest_size=HASH_BYTES, person=b"tokenrelay.scope")
        self._block = hashlib.blake2b(key=key, digest_size=HASH_BYTES, person=b"tokenrelay.block")

    def root(self, scope: bytes) -> bytes:
        """The chain state before the first block of a sequence in `scope`: a different scope
        gives a different hash to every block."""
        h = self._root.copy()
        h.update(scope)
        return h.digest()

    def block(self, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """The hash of a full block given its parent's (or its scope's root). The input is
        unambiguous: a fixed-size digest, then 8 bytes per token id."""
        h = self._block.copy()
        h.update(parent_hash)
        h.update(array("q", token_ids))
        return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its K/V written
    token_ids: tuple[int, ...] = ()  # what the K/V belong to (to verify a hash hit)
    scope: bytes = b""  # the cache scope it was computed under (verified too)
    parent_content_id: int = NO_PARENT
    content_id: int = NO_PARENT


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty = list(range(num_blocks - 1, -1, -1))  # a stack: lowest id on top
        self._cached: OrderedDict[int, None] = OrderedDict()  # free cached blocks, oldest first
        self._by_hash: dict[bytes, int] = {}  # block hash -> block id
        self._next_content_id = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: empty ones plus cached ones that can be evicted."""
        return len(self._empty) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref_count 1: empty blocks first, then the least recently freed cached ones."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"{n} blocks asked, {self.num_free_blocks} free (check num_free_blocks first)")
        ids = []
        for _ in range(n):
            if self._empty:
                block_id = self._empty.pop()
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._uncache(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent_content_id: int,
               scope: bytes = b"") -> Block | None:
        """The cached block holding exactly these tokens after that parent in that scope, or None."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if (block.parent_content_id != parent_content_id or block.token_ids != tuple(token_ids)
                or block.scope != scope):
            return None  # a hash collision: not the same prefix
        return block

    def acquire(self, block_id: int) -> None:
        """One more holder of a block found by `lookup` (taken off the free list if it was free)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        block.ref_count += 1

    def cache(self, block_id: int, block_hash: bytes, token_ids: Sequence[int], parent_content_id: int,
              scope: bytes = b"") -> bool:
        """Make a held, full block findable by its hash; False if that hash is already cached
        (another request computed the same block in the same step: this copy stays private)."""
        block = self.blocks[block_id]
        if block.ref_count < 1 or block.block_hash is not None:
            raise ValueError(f"block {block_id} is not held or already cached")
        if block_hash in self._by_hash:
            return False
        block.block_hash, block.token_ids, block.scope = block_hash, tuple(token_ids), scope
        block.parent_content_id = parent_content_id
        block.content_id, self._next_content_id = self._next_content_id, self._next_content_id + 1
        self._by_hash[block_hash] = block_id
        return True

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; pass a table tail first, so that among the blocks
        freed together the ends of sequences are evicted before their shared beginnings."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count < 1:
                raise ValueError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._empty.append(block_id)
                else:
                    self._cached[block_id] = None

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests and debugging)."""
        free = set(self._empty) | set(self._cached)
        assert len(free) == len(self._empty) + len(self._cached), "a block is on both free lists"
        for b in self.blocks:
            assert (b.ref_count == 0) == (b.block_id in free), f"block {b.block_id}: ref {b.ref_count}"
            assert (b.block_id in self._cached) <= (b.block_hash is not None), "uncached block in the LRU"
            if b.block_hash is not None:
                assert self._by_hash.get(b.block_hash) == b.block_id, f"block {b.block_id} not in the map"
        assert all(self.blocks[i].block_hash == h for h, i in self._by_hash.items()), "stale hash entry"

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
        block.block_hash, block.token_ids, block.scope = None, (), b""
        block.parent_content_id = block.content_id = NO_PARENT
