"""KVCacheManager under random sequences of the scheduler's operations (admit, prefill, decode,
speculative decode with rollback, finish, preempt, eviction pressure), checked after each against
a model of which K/V each physical block holds (the scope and token prefix it ends); once more with
a hash that collides all the time, the same for every scope."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.test_kv_manager import make_manager, snapshot
from worker.engine.block_pool import BlockHasher

ALPHABET = (0, 1, 2)
SCOPES = (b"", b"tenant-a", b"tenant-b")  # cache scopes: blocks are shared within one only
SHARED_PREFIXES = ((), (5, 6, 7, 8, 9, 10), (5, 6, 7, 8, 11, 12, 13, 14), tuple(range(20, 32)))
num_operations = Counter[str]()  # rules run, per machine
Content = tuple[bytes, tuple[int, ...]]  # what a block's K/V are: (scope, the token prefix it ends)


@dataclass
class Request:
    token_ids: list[int]  # prompt + generated
    num_prompt: int  # the original prompt (what `commit` calls prompt_ids)
    num_prefill: int  # what `allocate` got: the prompt, or prompt + generated after a preemption
    num_computed: int = 0
    num_committed: int = 0  # num_computed at the last commit
    num_reserved: int = 0  # after a speculative decode: the tokens whose blocks `trim` kept
    scope: bytes = b""

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= self.num_prefill


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a manager like the scheduler and the engine do, with a model of each request's
    tokens and of the K/V in each physical block (`content`: the token prefix a block ends)."""

    is_exact_hash = True  # False where hashes collide on purpose: hits may then fall short

    def make_hasher(self) -> BlockHasher:
        return BlockHasher()

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Request] = {}
        self.preempted: list[tuple[str, Request]] = []  # the front of the queue last
        self.num_ids = 0
        self.query_tokens = self.hit_tokens = 0

    @initialize(num_blocks=st.integers(8, 40), block_size=st.integers(1, 5), enable=st.booleans())
    def make(self, num_blocks: int, block_size: int, enable: bool) -> None:
        self.kv = make_manager(num_blocks, block_size, enable_prefix_caching=enable,
                               hasher=self.make_hasher())
        self.bs = block_size
        self.content: list[Content | None] = [None] * num_blocks

    # -- the model -------------------------------------------------------------------------------

    def prefix(self, scope: bytes, ids: Sequence[int], num_blocks: int) -> Content:
        return scope, tuple(ids[:num_blocks * self.bs])

    def cached_content(self) -> dict[Content | None, int]:
        return {self.content[b.block_id]: b.block_id for b in self.kv.pool.blocks if b.block_hash is not None}

    def expected_hits(self, scope: bytes, ids: Sequence[int]) -> list[int]:
        """The cached blocks of `scope` holding the longest prefix of full blocks, short of the
        last token."""
        if not self.kv.enable_prefix_caching:
            return []
        cached, hits = self.cached_content(), list[int]()
        while len(hits) < (len(ids) - 1) // self.bs and self.prefix(scope, ids, len(hits) + 1) in cached:
            hits.append(cached[self.prefix(scope, ids, len(hits) + 1)])
        return hits

    def expected_pending(self, scope: bytes, ids: Sequence[int]) -> bool:
        """A live request of the same scope has the next block after the hits in its prefill
        but not computed yet."""
        if not self.kv.enable_prefix_caching:
            return False
        end = (len(self.expected_hits(scope, ids)) + 1) * self.bs
        if end > len(ids) - 1:
            return False
        want = tuple(ids[:end])
        return any(r.num_computed < end <= r.num_prefill and r.scope == scope
                   and tuple(r.token_ids[:end]) == want for r in self.live.values())

    def new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    def pick(self, pick: int, is_wanted: Callable[[Request], bool] = lambda r: True) -> tuple[str, Request]:
        ids = [rid for rid, r in self.live.items() if is_wanted(r)]
        rid = ids[pick % len(ids)]
        return rid, self.live[rid]

    def try_allocate(self, rid: str, req: Request, num_reserved: int) -> bool:
        kv, ids, scope = self.kv, req.token_ids[:req.num_prefill], req.scope
        hits = self.expected_hits(scope, ids)
        if self.is_exact_hash:
            assert kv.is_prefix_pending(ids, scope=scope) == self.expected_pending(scope, ids)
        num_taken = kv.blocks_for(len(ids)) - len(hits) + sum(kv.pool.blocks[b].ref_count == 0 for b in hits)
        before = snapshot(kv)
        num_cached = kv.allocate(rid, ids, num_reserved, scope=scope)
        if self.is_exact_hash:
            assert (num_cached is not None) == (num_taken <= before[0] - num_reserved)
        if num_cached is None:
            assert snapshot(kv) == before and not kv.has(rid)
            return False
        self.live[rid] = req
        req.num_computed = req.num_committed = num_cached
        self.query_tokens += len(ids)
        self.hit_tokens += num_cached
        assert num_cached % self.bs == 0 and num_cached < len(ids)
        num_hits = num_cached // self.bs
        if self.is_exact_hash:
            assert num_hits == len(hits)
        assert num_hits <= len(hits)
        table = kv.block_table(rid)
        assert len(table) == kv.blocks_for(len(ids))
        for j, block_id in enumerate(table):
            if j < num_hits:  # a hit is exactly this scope's and prefix's K/V
                assert self.content[block_id] == self.prefix(scope, ids, j + 1)
            else:
                self.content[block_id] = None  # nothing written yet
        return True

    def commit(self, rid: str, req: Request) -> None:
        """The step ran: `req.num_computed` tokens' K/V are written."""
        prompt_ids, output_ids = req.token_ids[:req.num_prompt], req.token_ids[req.num_prompt:]
        self.kv.commit(rid, req.num_computed, prompt_ids, output_ids)
        table = self.kv.block_table(rid)
        for j in range(req.num_committed // self.bs, req.num_computed // self.bs):
            self.content[table[j]] = self.prefix(req.scope, req.token_ids, j + 1)
            if self.is_exact_hash and self.kv.enable_prefix_caching:  # this block or a copy is cached
                assert self.prefix(req.scope, req.token_ids, j + 1) in self.cached_content()
        req.num_committed = req.num_computed

    # -- rules -----------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(SHARED_PREFIXES), suffix=st.lists(st.sampled_from(ALPHABET), min_size=1,
                                                                  max_size=8),
          num_copies=st.integers(1, 3), num_reserved=st.integers(0, 3), scope=st.sampled_from(SCOPES))
    def admit(self, prefix: tuple[int, ...], suffix: list[int], num_copies: int, num_reserved: int,
              scope: bytes) -> None:
        """New requests arriving together with the same prompt (n > 1 samples, retries); the shared
        prefixes come in every scope (one system prompt, several tenants)."""
        num_operations[type(self).__name__] += 1
        for _ in range(num_copies):
            ids = [*prefix, *suffix]
            self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids), scope=scope), num_reserved)

    @precondition(lambda self: any(b.block_hash is not None for b in self.kv.pool.blocks))
    @rule(pick=st.integers(0, 99), token=st.sampled_from(ALPHABET), num_reserved=st.integers(0, 3),
          is_same_scope=st.booleans())
    def admit_cached(self, pick: int, token: int, num_reserved: int, is_same_scope: bool) -> None:
        """A new request whose prompt continues a cached block's prefix: all of it should hit in
        that block's scope, none of it in the next scope."""
        num_operations[type(self).__name__] += 1
        cached = sorted(c for c in self.cached_content() if c is not None)
        scope, prefix = cached[pick % len(cached)]
        if not is_same_scope:
            scope = SCOPES[(SCOPES.index(scope) + 1) % len(SCOPES)]
        ids = [*prefix, token]
        self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids), scope=scope), num_reserved)

    @precondition(lambda self: any(b.block_hash is not None for b in self.kv.pool.blocks))
    @rule(token=st.sampled_from(ALPHABET))
    def short_questions(self, token: int) -> None:
        """One short request per cached prefix, each finishing at once: every cached block is a hit."""
        num_operations[type(self).__name__] += 1
        for scope, prefix in sorted(c for c in self.cached_content() if c is not None):
            rid = self.new_id()
            ids = [*prefix, token]
            if self.try_allocate(rid, Request(ids, len(ids), len(ids), scope=scope), 0):
                self.kv.free(rid)
                del self.live[rid]

    @precondition(lambda self: self.live or self.preempted)
    @rule(pick=st.integers(0, 99), num_kept=st.integers(1, 40), token=st.sampled_from(ALPHABET),
          num_reserved=st.integers(0, 3), scope=st.sampled_from((None, *SCOPES)))
    def follow_up(self, pick: int, num_kept: int, token: int, num_reserved: int, scope: bytes | None) -> None:
        """A new request that repeats the start of another one's conversation (a retry, a next turn),
        in the same scope (None) or a given one (someone else guessing the conversation)."""
        num_operations[type(self).__name__] += 1
        others = list(self.live.values()) + [r for _, r in self.preempted]
        other = others[pick % len(others)]
        ids = [*other.token_ids[:num_kept], token]
        scope = other.scope if scope is None else scope
        self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids), scope=scope), num_reserved)

    @precondition(lambda self: any(not r.is_decoding for r in self.live.values()))
    @rule(pick=st.integers(0, 99), num_tokens=st.integers(1, 12), token=st.sampled_from(ALPHABET))
    def prefill_chunk(self, pick: int, num_tokens: int, token: int) -> None:
        num_operations[type(self).__name__] += 1
        rid, req = self.pick(pick, lambda r: not r.is_decoding)
        req.num_computed = min(req.num_prefill, req.num_computed + num_tokens)
        self.commit(rid, req)
        if req.is_decoding:
            req.token_ids.append(token)  # sampled from the last prompt token's logits

    @precondition(lambda self: any(r.is_decoding for r in self.live.values()))
    @rule(pick=st.integers(0, 99), token=st.sampled_from(ALPHABET))
    def decode(self, pick: int, token: int) -> None:
        num_operations[type(self).__name__] += 1
        rid, req = self.pick(pick, lambda r: r.is_decoding)
        if self.grow(rid, req):  # else the scheduler preempts someone
            req.num_computed = len(req.token_ids)
            self.commit(rid, req)
            req.token_ids.append(token)

    @precondition(lambda self: any(r.is_decoding for r in self.live.values()))
    @rule(pick=st.integers(0, 99), draft=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=6),
          num_accepted=st.integers(0, 6), token=st.sampled_from(ALPHABET))
    def speculate(self, pick: int, draft: list[int], num_accepted: int, token: int) -> None:
        """A verified decode as the scheduler and `Scheduler.commit` run it: room for the last token
        and the proposals (else a plain decode), K/V written for all, only the accepted ones then
        computed, the target's own token after them, the blocks past the kept tokens freed (`trim`)."""
        num_operations[type(self).__name__] += 1
        rid, req = self.pick(pick, lambda r: r.is_decoding)
        kv, n = self.kv, len(req.token_ids)
        if not self.grow(rid, req):
            return  # the scheduler preempts someone
        before = snapshot(kv)
        if not kv.grow(rid, n + len(draft)):
            assert snapshot(kv) == before
            draft = []  # no room to speculate: a plain decode
        for block_id in kv.block_table(rid)[kv.blocks_for(n):]:
            self.content[block_id] = None  # positions n - 1 .. n - 1 + k written, the tail uncached
        m = min(num_accepted, len(draft))
        req.num_computed = n + m  # the last token and the accepted proposals
        req.token_ids += [*draft[:m], token]
        self.commit(rid, req)
        table = list(kv.block_table(rid))
        kv.trim(rid, len(req.token_ids))
        req.num_reserved = min(len(req.token_ids), n + len(draft))  # room held for the target's token
        assert kv.block_table(rid) == table[:kv.blocks_for(len(req.token_ids))]  # only the tail goes

    @precondition(lambda self: self.live)
    @rule(budget=st.integers(1, 24), token=st.sampled_from(ALPHABET))
    def engine_step(self, budget: int, token: int) -> None:
        """One engine step as the scheduler and `Scheduler.commit` run it: every prefilled request
        decodes (the newest are preempted while a block is missing), prompts are prefilled
        oldest first under a token budget, then every request that ran commits."""
        num_operations[type(self).__name__] += 1
        for rid in list(self.live):
            req = self.live.get(rid)
            if req is None or not req.is_decoding:
                continue
            while not self.grow(rid, req):
                victim = next(reversed(self.live))
                self.preempted.append((victim, self.live.pop(victim)))
                self.kv.free(victim)
                if victim == rid:
                    break
        ran = []
        for rid, req in self.live.items():
            if req.is_decoding:
                req.num_computed = len(req.token_ids)
            elif budget > 0:
                num_tokens = min(req.num_prefill - req.num_computed, budget)
                budget -= num_tokens
                req.num_computed += num_tokens
            else:
                continue
            ran.append((rid, req))
        for i, (rid, req) in enumerate(ran):
            self.commit(rid, req)
            if req.is_decoding:
                req.token_ids.append(ALPHABET[(token + i) % len(ALPHABET)])

    def grow(self, rid: str, req: Request) -> bool:
        """Room for the last sampled token; False (and nothing changed) when the pool is out of blocks."""
        kv, num_tokens = self.kv, len(req.token_ids)
        table, before = list(kv.block_table(rid)), snapshot(kv)
        fits = kv.blocks_for(num_tokens) - len(table) <= kv.num_free_blocks
        assert kv.grow(rid, num_tokens) == fits
        if not fits:
            assert kv.block_table(rid) == table and snapshot(kv) == before
            return False
        grown = kv.block_table(rid)
        assert grown[:len(table)] == table and len(grown) == kv.blocks_for(num_tokens)
        for block_id in grown[len(table):]:
            self.content[block_id] = None
        return True

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick: int) -> None:
        num_operations[type(self).__name__] += 1
        rid, _ = self.pick(pick)
        self.kv.free(rid)
        del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick: int) -> None:
        num_operations[type(self).__name__] += 1
        rid, req = self.pick(pick)
        self.kv.free(rid)
        del self.live[rid]
        self.preempted.append((rid, req))

    @precondition(lambda self: self.preempted)
    @rule(num_reserved=st.integers(0, 3))
    def resume(self, num_reserved: int) -> None:
        """Readmit the last preempted request: prompt + generated, mostly cached."""
        num_operations[type(self).__name__] += 1
        rid, req = self.preempted[-1]
        resumed = Request(req.token_ids, req.num_prompt, len(req.token_ids), scope=req.scope)
        if self.try_allocate(rid, resumed, num_reserved):
            self.preempted.pop()

    @rule(num_tokens=st.integers(1, 12), max_fillers=st.integers(1, 40), keep=st.booleans())
    def pressure(self, num_tokens: int, max_fillers: int, keep: bool) -> None:
        """Admit requests of fresh tokens until one fails (or `max_fillers` fit): the oldest
        cached blocks are evicted. They finish at once, or the first stays (a long request)."""
        num_operations[type(self).__name__] += 1
        fillers = []
        for _ in range(max_fillers):
            ids = list(range(100 + self.num_ids * 12, 100 + self.num_ids * 12 + num_tokens))
            rid = self.new_id()
            if not self.try_allocate(rid, Request(ids, len(ids), len(ids)), 0):
                break
            fillers.append(rid)
        for rid in fillers[1:] if keep else fillers:
            self.kv.free(rid)
            del self.live[rid]

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        kv, pool = self.kv, self.kv.pool
        kv.check()
        tables = {rid: kv.block_table(rid) for rid in self.live}
        assert not any(kv.has(rid) for rid, _ in self.preempted)
        refs = Counter(b for table in tables.values() for b in table)
        assert sum(b.ref_count for b in pool.blocks) == refs.total()
        assert all(b.ref_count == refs[b.block_id] for b in pool.blocks)
        num_held = sum(b.ref_count > 0 for b in pool.blocks)
        assert kv.num_free_blocks + num_held == kv.num_blocks
        assert kv.usage == num_held / kv.num_blocks
        for b in pool.blocks:
            if pool.is_cached_free(b.block_id):
                assert b.ref_count == 0 and b.block_hash is not None
        hashes = [b.block_hash for b in pool.blocks if b.block_hash is not None]
        assert len(set(hashes)) == len(hashes)
        if not kv.enable_prefix_caching:
            assert not hashes
        assert (kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens) == (self.query_tokens, self.hit_tokens)

    @invariant()
    def cached_blocks_hold_their_prefix(self) -> None:
        """Every cached block in a table holds exactly that request's tokens, computed in its scope:
        a hit never returns the K/V of another prefix or scope. Only cached blocks are shared."""
        pool, bs = self.kv.pool, self.bs
        for rid, req in self.live.items():
            table = self.kv.block_table(rid)
            assert len(table) == self.kv.blocks_for(max(req.num_prefill, req.num_computed, req.num_reserved))
            assert len(set(table)) == len(table)
            for j, block_id in enumerate(table):
                block = pool.blocks[block_id]
                assert block.ref_count == 1 or block.block_hash is not None
                if block.block_hash is not None:
                    assert (j + 1) * bs <= req.num_computed
                    assert block.token_ids == tuple(req.token_ids[j * bs:(j + 1) * bs])
                    assert block.scope == req.scope
                    assert self.content[block_id] == self.prefix(req.scope, req.token_ids, j + 1)

    def teardown(self) -> None:
        kv = getattr(self, "kv", None)
        if kv is None:
            return
        for rid in list(self.live):
            kv.free(rid)
        kv.check()
        assert kv.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.pool.blocks)
        assert not kv._pending  # no hash stays "being computed"


class CollidingHasher(BlockHasher):
    """One root for every scope and eight block hashes: most blocks collide with another prefix's,
    and every scope's with the others'. A fixed key: hypothesis replays a run only if the same
    blocks collide each time."""

    def __init__(self) -> None:
        super().__init__(key=b"colliding")

    def root(self, scope: bytes) -> bytes:
        return b"root"

    def block(self, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        return bytes([super().block(parent_hash, token_ids)[0] % 8])


class CollidingHashMachine(KVCacheMachine):
    is_exact_hash = False

    def make_hasher(self) -> BlockHasher:
        return CollidingHasher()


def machine_settings(max_examples: int, stateful_step_count: int) -> settings:
    """No shrinking: on runs this long it takes minutes, so the failing steps are printed as found
    (the example database replays them first next time; add Phase.shrink locally to minimise)."""
    return settings(max_examples=max_examples, stateful_step_count=stateful_step_count, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def test_kv_cache_manager_matches_its_model() -> None:
    start = num_operations["KVCacheMachine"]
    run_state_machine_as_test(KVCacheMachine, settings=machine_settings(130, 150))
    assert num_operations["KVCacheMachine"] - start >= 10_000


def test_hash_collisions_never_give_another_prefix_or_scope_kv() -> None:
    start = num_operations["CollidingHashMachine"]
    run_state_machine_as_test(CollidingHashMachine, settings=machine_settings(40, 100))
    assert num_operations["CollidingHashMachine"] - start >= 2_000
