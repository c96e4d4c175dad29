"""Which blocks each request's K/V live in, and which prefixes are cached (no torch).

A request's block table maps its token positions to physical blocks:
position p is in block `table[p // block_size]` at offset `p % block_size`.

- Admission (`allocate`) looks the prompt up full block by full block among
  the blocks of the request's cache scope (a scope never sees another's: see
  block_pool.py); the leading blocks found cached are shared (their ref count
  goes up) and the rest of the prompt gets new blocks at once, so a prompt
  being prefilled in chunks never runs out of room half-way. At least the
  last prompt token is always computed: its logits give the first output token.
- Decoding (`grow`) adds a block when a sequence crosses a block boundary.
- After a step has written a block's K/V (`commit`), the block is hashed and
  becomes findable; hashing earlier could hand another request K/V that a
  failed step never wrote.
- `free` (finish, abort or preemption) releases a request's blocks; its full
  blocks stay cached until the pool needs them (see block_pool.py).

Requests admitted in the same step cannot share what neither has computed
yet, so `is_prefix_pending` tells the scheduler that a waiting prompt's next
block is being computed right now by another request: waiting one step turns
that block into a hit instead of a second copy (32 calls of one scope with
one system prompt arriving together store it once).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.engine.block_pool import NO_PARENT, BlockHasher, BlockPool

_Chain = tuple[bytes, int]  # chain state before a block: (its parent's hash, its parent's content id)


@dataclass
class _Table:
    scope: bytes
    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks that are cached (hits, or hashed by commit)
    last_hash: bytes = b""  # chain state after the hashed blocks (the scope's root before any)
    last_content_id: int = NO_PARENT
    pending: list[bytes] = field(default_factory=list)  # hashes of full prompt blocks not yet computed
    can_hash: bool = True  # False after a hash collision: this request caches nothing further
    # Changes (to a value no table had) whenever block_ids change other than by appending, so a
    # copy kept across steps (input_batch.py) knows to rewrite rather than extend.
    version: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool = True, hasher: BlockHasher | None = None) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.hasher = hasher or BlockHasher()  # a random key of its own
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, _Table] = {}
        self._versions = itertools.count(1)
        self._pending: Counter[bytes] = Counter()  # block hash -> requests about to compute it
        # Statistics since start (prompt tokens; hits are what prefill did not compute).
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of the blocks held by requests (free cached blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one sequence can ever hold: the context, or the whole pool."""
        return min(self.max_model_len, self.pool.num_blocks * self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id].block_ids

    def table_version(self, request_id: str) -> int:
        """Equal across two calls only if the table was at most appended to in between."""
        return self._tables[request_id].version

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    # -- admission --------------------------------------------------------------------------------

    def allocate(self, request_id: str, token_ids: Sequence[int], num_reserved: int = 0, *,
                 scope: bytes = b"") -> int | None:
        """Blocks for all of `token_ids` (the tokens prefill will compute), sharing the prefix
        cached in `scope`. Returns how many leading tokens are cached, or None (nothing changes)
        when the blocks do not fit while leaving `num_reserved` free for running decodes."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        if not token_ids:
            raise ValueError("a request needs at least one token")
        hits, chain = self._lookup(token_ids, scope)
        num_new = self.blocks_for(len(token_ids)) - len(hits)
        taken_free = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)  # leave the free list
        if num_new + taken_free > self.pool.num_free_blocks - num_reserved:
            return None
        for block_id in hits:
            self.pool.acquire(block_id)
        table = _Table(scope, hits + self.pool.allocate(num_new), len(hits), *chain[len(hits)])
        table.version = next(self._versions)
        if self.enable_prefix_caching:
            table.pending = self._full_block_hashes(token_ids, len(hits), table.last_hash)
            self._pending.update(table.pending)
        self._tables[request_id] = table
        num_cached = len(hits) * self.block_size
        self.num_prefix_query_tokens += len(token_ids)
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    def is_prefix_pending(self, token_ids: Sequence[int], *, scope: bytes = b"") -> bool:
        """Another running request in the same scope is computing, this step, the first block
        of these tokens that is not cached yet."""
        if not self._pending:
            return False
        hits, chain = self._lookup(token_ids, scope)
        start = len(hits) * self.block_size
        if start + self.block_size > len(token_ids) - 1:
            return False  # no further full block could be a hit anyway
        block_hash = self.hasher.block(chain[len(hits)][0], token_ids[start:start + self.block_size])
        return block_hash in self._pending

    # -- running ----------------------------------------------------------------------------------

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make room for `num_tokens` positions; False (nothing changes) if the pool is out of blocks."""
        table = self._tables[request_id]
        num_new = self.blocks_for(num_tokens) - len(table.block_ids)
        if num_new <= 0:
            return True
        if num_new > self.pool.num_free_blocks:
            return False
        table.block_ids += self.pool.allocate(num_new)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep blocks for `num_tokens` positions only: give back those a speculative step reserved
        past what it accepted (tail first). Never a hashed block: those hold computed tokens."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = max(self.blocks_for(num_tokens), table.num_hashed)
        if keep < len(table.block_ids):
            tail, table.block_ids = table.block_ids[keep:], table.block_ids[:keep]
            table.version = next(self._versions)
            self.pool.release(reversed(tail))

    def commit(self, request_id: str, num_computed: int, prompt_ids: Sequence[int],
               output_ids: Sequence[int] = ()) -> None:
        """The K/V of the first `num_computed` tokens of prompt + output are now written:
        hash the blocks that became full."""
        table = self._tables.get(request_id)
        if table is None or not self.enable_prefix_caching or not table.can_hash:
            return
        bs = self.block_size
        num_full = min(num_computed, len(prompt_ids) + len(output_ids)) // bs
        if num_full <= table.num_hashed:
            return  # the common decode step: no block filled up
        token_ids = [*prompt_ids, *output_ids] if len(prompt_ids) < num_full * bs else prompt_ids
        for j in range(table.num_hashed, num_full):
            tokens = token_ids[j * bs:(j + 1) * bs]
            block_hash = self.hasher.block(table.last_hash, tokens)
            self._unpend(table, block_hash)
            block_id = table.block_ids[j]
            if not self.pool.cache(block_id, block_hash, tokens, table.last_content_id, table.scope):
                twin = self.pool.lookup(block_hash, tokens, table.last_content_id, table.scope)
                if twin is None:  # a collision with another prefix or scope: stop caching this request
                    table.can_hash = False
                    self._drop_pending(table)  # nobody should wait for blocks it will never cache
                    return
                # The same prefix computed twice: hold the cached copy instead of ours, so the
                # chain never goes through a block this request does not hold (which could be
                # evicted while its children stay cached, unreachable).
                self.pool.acquire(twin.block_id)
                self.pool.release([block_id])
                table.block_ids[j] = block_id = twin.block_id
                table.version = next(self._versions)
            table.num_hashed, table.last_hash = j + 1, block_hash
            table.last_content_id = self.pool.blocks[block_id].content_id

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first: evicted before shared beginnings)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._drop_pending(table)
        self.pool.release(reversed(table.block_ids))

    def check(self) -> None:
        """Raise AssertionError if tables and pool disagree (tests and debugging)."""
        self.pool.check()
        refs = Counter(b for t in self._tables.values() for b in t.block_ids)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref count off"
        assert self._pending == Counter(h for t in self._tables.values() for h in t.pending)

    # -- hashing ----------------------------------------------------------------------------------

    def _lookup(self, token_ids: Sequence[int], scope: bytes) -> tuple[list[int], list[_Chain]]:
        """Cached leading full blocks of `scope` (at most up to the last token, which is always
        computed), and the chain state before each block and after the last hit."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits, [(b"", NO_PARENT)]  # nothing is hashed: no root needed
        chain = [(self.hasher.root(scope), NO_PARENT)]
        bs = self.block_size
        for j in range((len(token_ids) - 1) // bs):
            tokens = token_ids[j * bs:(j + 1) * bs]
            block_hash = self.hasher.block(chain[-1][0], tokens)
            block = self.pool.lookup(block_hash, tokens, chain[-1][1], scope)
            if block is None:
                break
            hits.append(block.block_id)
            chain.append((block_hash, block.content_id))
        return hits, chain

    def _full_block_hashes(self, token_ids: Sequence[int], start: int, parent_hash: bytes) -> list[bytes]:
        """Chain hashes of full blocks start, start + 1, ... of token_ids."""
        hashes, bs = [], self.block_size
        for j in range(start, len(token_ids) // bs):
            parent_hash = self.hasher.block(parent_hash, token_ids[j * bs:(j + 1) * bs])
            hashes.append(parent_hash)
        return hashes

    def _drop_pending(self, table: _Table) -> None:
        for block_hash in table.pending:
            self._pending[block_hash] -= 1
        self._pending = +self._pending  # drop zero counts
        table.pending = []

    def _unpend(self, table: _Table, block_hash: bytes) -> None:
        if table.pending and table.pending[0] == block_hash:
            table.pending.pop(0)
            self._pending[block_hash] -= 1
            if self._pending[block_hash] <= 0:
                del self._pending[block_hash]
