"""KVCacheManager: block tables, prefix hits and the scheduler's flow (admit, prefill, decode,
finish, preempt) checked against a model of which K/V each physical block holds."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
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

from worker.engine import kv_manager as kv_manager_module
from worker.engine.kv_manager import KVCacheManager


def make_manager(num_blocks: int = 64, block_size: int = 4, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, max_model_len or num_blocks * block_size,
                          enable_prefix_caching)


def tokens(n: int, seed: int = 0) -> list[int]:
    """n token ids; different seeds give different sequences."""
    rng = random.Random(seed)
    return [rng.randrange(1_000) for _ in range(n)]


def prefill(kv: KVCacheManager, request_id: str, ids: list[int], num_reserved: int = 0) -> int:
    """Admit and prefill in one step, as the scheduler and `Scheduler.commit` do."""
    num_cached = kv.allocate(request_id, ids, num_reserved)
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
            tuple((b.ref_count, b.block_hash, b.token_ids, b.content_id) for b in pool.blocks),
            tuple(pool.is_cached_free(i) for i in range(pool.num_blocks)))


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


# -- the state machine -----------------------------------------------------------------------------------

ALPHABET = (0, 1, 2)
SHARED_PREFIXES = ((), (5, 6, 7, 8, 9, 10), (5, 6, 7, 8, 11, 12, 13, 14), tuple(range(20, 32)))
num_operations = Counter[str]()  # rules run, per machine


@dataclass
class Request:
    token_ids: list[int]  # prompt + generated
    num_prompt: int  # the original prompt (what `commit` calls prompt_ids)
    num_prefill: int  # what `allocate` got: the prompt, or prompt + generated after a preemption
    num_computed: int = 0
    num_committed: int = 0  # num_computed at the last commit

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= self.num_prefill


class KVCacheMachine(RuleBasedStateMachine):
    """Drives a manager like the scheduler and the engine do, with a model of each request's
    tokens and of the K/V in each physical block (`content`: the token prefix a block ends)."""

    is_exact_hash = True  # False where hashes collide on purpose: hits may then fall short

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, Request] = {}
        self.preempted: list[tuple[str, Request]] = []  # the front of the queue last
        self.num_ids = 0
        self.query_tokens = self.hit_tokens = 0

    @initialize(num_blocks=st.integers(8, 40), block_size=st.integers(1, 5), enable=st.booleans())
    def make(self, num_blocks: int, block_size: int, enable: bool) -> None:
        self.kv = make_manager(num_blocks, block_size, enable_prefix_caching=enable)
        self.bs = block_size
        self.content: list[tuple[int, ...] | None] = [None] * num_blocks

    # -- the model -------------------------------------------------------------------------------

    def prefix(self, ids: Sequence[int], num_blocks: int) -> tuple[int, ...]:
        return tuple(ids[:num_blocks * self.bs])

    def cached_content(self) -> dict[tuple[int, ...] | None, int]:
        return {self.content[b.block_id]: b.block_id for b in self.kv.pool.blocks if b.block_hash is not None}

    def expected_hits(self, ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of full blocks, short of the last token."""
        if not self.kv.enable_prefix_caching:
            return []
        cached, hits = self.cached_content(), list[int]()
        while len(hits) < (len(ids) - 1) // self.bs and self.prefix(ids, len(hits) + 1) in cached:
            hits.append(cached[self.prefix(ids, len(hits) + 1)])
        return hits

    def expected_pending(self, ids: Sequence[int]) -> bool:
        """A live request has the next block after the hits in its prefill but not computed yet."""
        if not self.kv.enable_prefix_caching:
            return False
        end = (len(self.expected_hits(ids)) + 1) * self.bs
        if end > len(ids) - 1:
            return False
        want = tuple(ids[:end])
        return any(r.num_computed < end <= r.num_prefill and tuple(r.token_ids[:end]) == want
                   for r in self.live.values())

    def new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    def pick(self, pick: int, is_wanted: Callable[[Request], bool] = lambda r: True) -> tuple[str, Request]:
        ids = [rid for rid, r in self.live.items() if is_wanted(r)]
        rid = ids[pick % len(ids)]
        return rid, self.live[rid]

    def try_allocate(self, rid: str, req: Request, num_reserved: int) -> bool:
        kv, ids = self.kv, req.token_ids[:req.num_prefill]
        hits = self.expected_hits(ids)
        if self.is_exact_hash:
            assert kv.is_prefix_pending(ids) == self.expected_pending(ids)
        num_taken = kv.blocks_for(len(ids)) - len(hits) + sum(kv.pool.blocks[b].ref_count == 0 for b in hits)
        before = snapshot(kv)
        num_cached = kv.allocate(rid, ids, num_reserved)
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
            if j < num_hits:  # a hit is exactly this prefix's K/V
                assert self.content[block_id] == self.prefix(ids, j + 1)
            else:
                self.content[block_id] = None  # nothing written yet
        return True

    def commit(self, rid: str, req: Request) -> None:
        """The step ran: `req.num_computed` tokens' K/V are written."""
        prompt_ids, output_ids = req.token_ids[:req.num_prompt], req.token_ids[req.num_prompt:]
        self.kv.commit(rid, req.num_computed, prompt_ids, output_ids)
        table = self.kv.block_table(rid)
        for j in range(req.num_committed // self.bs, req.num_computed // self.bs):
            self.content[table[j]] = self.prefix(req.token_ids, j + 1)
            if self.is_exact_hash and self.kv.enable_prefix_caching:  # this block or a copy is cached
                assert self.prefix(req.token_ids, j + 1) in self.cached_content()
        req.num_committed = req.num_computed

    # -- rules -----------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(SHARED_PREFIXES), suffix=st.lists(st.sampled_from(ALPHABET), min_size=1,
                                                                  max_size=8),
          num_copies=st.integers(1, 3), num_reserved=st.integers(0, 3))
    def admit(self, prefix: tuple[int, ...], suffix: list[int], num_copies: int, num_reserved: int) -> None:
        """New requests arriving together with the same prompt (n > 1 samples, retries)."""
        num_operations[type(self).__name__] += 1
        for _ in range(num_copies):
            ids = [*prefix, *suffix]
            self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids)), num_reserved)

    @precondition(lambda self: any(b.block_hash is not None for b in self.kv.pool.blocks))
    @rule(pick=st.integers(0, 99), token=st.sampled_from(ALPHABET), num_reserved=st.integers(0, 3))
    def admit_cached(self, pick: int, token: int, num_reserved: int) -> None:
        """A new request whose prompt continues a cached block's prefix: all of it should hit."""
        num_operations[type(self).__name__] += 1
        cached = sorted(c for c in self.cached_content() if c is not None)
        ids = [*cached[pick % len(cached)], token]
        self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids)), num_reserved)

    @precondition(lambda self: any(b.block_hash is not None for b in self.kv.pool.blocks))
    @rule(token=st.sampled_from(ALPHABET))
    def short_questions(self, token: int) -> None:
        """One short request per cached prefix, each finishing at once: every cached block is a hit."""
        num_operations[type(self).__name__] += 1
        for prefix in sorted(c for c in self.cached_content() if c is not None):
            rid = self.new_id()
            if self.try_allocate(rid, Request([*prefix, token], len(prefix) + 1, len(prefix) + 1), 0):
                self.kv.free(rid)
                del self.live[rid]

    @precondition(lambda self: self.live or self.preempted)
    @rule(pick=st.integers(0, 99), num_kept=st.integers(1, 40), token=st.sampled_from(ALPHABET),
          num_reserved=st.integers(0, 3))
    def follow_up(self, pick: int, num_kept: int, token: int, num_reserved: int) -> None:
        """A new request that repeats the start of another one's conversation (a retry, a next turn)."""
        num_operations[type(self).__name__] += 1
        others = [r.token_ids for r in self.live.values()] + [r.token_ids for _, r in self.preempted]
        ids = [*others[pick % len(others)][:num_kept], token]
        self.try_allocate(self.new_id(), Request(ids, len(ids), len(ids)), num_reserved)

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
        resumed = Request(req.token_ids, req.num_prompt, len(req.token_ids))
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
        """Every cached block in a table holds exactly that request's tokens: a hit never returns
        the K/V of another prefix. Only cached blocks are shared."""
        pool, bs = self.kv.pool, self.bs
        for rid, req in self.live.items():
            table = self.kv.block_table(rid)
            assert len(table) == self.kv.blocks_for(max(req.num_prefill, req.num_computed))
            assert len(set(table)) == len(table)
            for j, block_id in enumerate(table):
                block = pool.blocks[block_id]
                assert block.ref_count == 1 or block.block_hash is not None
                if block.block_hash is not None:
                    assert (j + 1) * bs <= req.num_computed
                    assert block.token_ids == tuple(req.token_ids[j * bs:(j + 1) * bs])
                    assert self.content[block_id] == self.prefix(req.token_ids, j + 1)

    def teardown(self) -> None:
        kv = getattr(self, "kv", None)
        if kv is None:
            return
        for rid in list(self.live):
            kv.free(rid)
        kv.check()
        assert kv.num_free_blocks == kv.num_blocks and all(b.ref_count == 0 for b in kv.pool.blocks)
        assert not kv._pending  # no hash stays "being computed"


class CollidingHashMachine(KVCacheMachine):
    is_exact_hash = False


def colliding_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Eight values: most blocks collide with another prefix's."""
    return hash((parent_hash, tuple(token_ids))) % 8


def machine_settings(max_examples: int, stateful_step_count: int) -> settings:
    """No shrinking: on runs this long it takes minutes, so the failing steps are printed as found
    (the example database replays them first next time; add Phase.shrink locally to minimise)."""
    return settings(max_examples=max_examples, stateful_step_count=stateful_step_count, deadline=None,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def test_kv_cache_manager_matches_its_model() -> None:
    start = num_operations["KVCacheMachine"]
    run_state_machine_as_test(KVCacheMachine, settings=machine_settings(130, 150))
    assert num_operations["KVCacheMachine"] - start >= 10_000


def test_hash_collisions_never_give_another_prefix_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_manager_module, "chain_hash", colliding_hash)
    start = num_operations["CollidingHashMachine"]
    run_state_machine_as_test(CollidingHashMachine, settings=machine_settings(40, 100))
    assert num_operations["CollidingHashMachine"] - start >= 2_000
