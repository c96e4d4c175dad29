"""Who runs next: decode the running, prefill prompts under a token budget, admit
while KV blocks last, preempt when they run out (no torch).

Each step, in this order:

1. Every prefilled running sequence decodes one token. Crossing a block
   boundary needs a new block; when the pool has none, a running request is
   preempted (its blocks freed, its full blocks left cached) until the one
   decoding fits: the lowest `params.priority` first, the newest among equals.
   A preempted request goes back to the front of the queue and later
   recomputes prompt + generated tokens, mostly from the prefix cache, and
   goes on with the same seed: its stream only pauses.
2. Up to `max_prefill_tokens` prompt tokens (and, with `max_num_batched_tokens`, the
   step's token budget shared with the decodes: vLLM's, so a GPU step's size is bounded
   whatever mix it has): first the next chunks of prompts
   already being prefilled (older first), then the prompts of newly admitted
   requests, FIFO. A prompt longer than what is left of the budget is
   prefilled in chunks over several steps, next to the running decodes.
3. A waiting request is admitted when the batch has room (`max_num_seqs`) and
   the blocks of its uncached prompt fit while one block per running request
   stays free for their decodes. Nothing is admitted in a step that preempted
   (it would take back the blocks just freed). A request never fits only if it
   is larger than the pool, and `Engine` refuses those up front: nothing waits
   forever. With LoRA, the running requests use at most `max_adapters`
   distinct adapters (the base model not counted), so every step does; a
   request of a further adapter waits, FIFO as for blocks, until one of them
   has no running request left: the running ones only drain meanwhile, so it
   never starves.
4. Speculation (after the decodes above, so it never preempts anyone): a
   decode with proposals also gets the blocks for its k proposal positions,
   or, when the pool has none to spare, drops its proposals and runs as a
   plain decode. Under a token budget, proposals get only what is left after
   the decodes and the prompt tokens waiting for this step (they are optional
   work: they never starve a prompt), the oldest decode's first. `commit`
   then counts only the accepted tokens as computed and hands the blocks past
   them back (`KVCacheManager.trim`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from protos.params import FinishReason
from worker.engine.kv_manager import KVCacheManager
from worker.engine.sequence import PrefillChunk, Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)  # prompt chunks run this step
    decodes: list[Sequence] = field(default_factory=list)  # one token each, oldest first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_decode_tokens(self) -> int:
        """Tokens the decodes compute: each its last token and its proposals."""
        return sum(1 + len(s.spec.draft_ids) for s in self.decodes)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_prefill_tokens: int,
                 max_adapters: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        if max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_prefill_tokens "
                             f"({max_prefill_tokens}) must be >= 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running request decodes a token each step")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens  # None: no budget shared with decodes
        self.max_adapters = max_adapters  # None: no limit
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # in admission order
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.kv.max_num_tokens:
            raise ValueError(f"sequence of {seq.num_tokens} tokens exceeds what one sequence can hold "
                             f"({self.kv.max_num_tokens} tokens)")
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        budget = self.max_prefill_tokens
        if self.max_num_batched_tokens is not None:
            budget = min(budget, self.max_num_batched_tokens - out.num_decode_tokens)
        for seq in self.running.values():  # admission order: older prompts finish first
            if budget > 0 and not seq.is_prefilled:
                budget -= self._add_chunk(out, seq, budget)
        adapters = {s.adapter for s in self.running.values() if s.adapter}
        while budget > 0 and self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (seq.adapter and seq.adapter not in adapters and self.max_adapters is not None
                    and len(adapters) >= self.max_adapters):
                break  # FIFO: waits for one of the running adapters to drain
            prefill_ids = seq.prefill_ids
            if self.kv.is_prefix_pending(prefill_ids, scope=seq.cache_scope):
                break  # computed this step by another request: a cache hit next step
            num_cached = self.kv.allocate(seq.request_id, prefill_ids, num_reserved=len(self.running),
                                          scope=seq.cache_scope)
            if num_cached is None:
                break  # FIFO: no request overtakes one that waits for blocks
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached  # prefill starts after the cached prefix
            if seq.admitted_time is None:
                seq.num_cached_tokens = num_cached
                seq.admitted_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            if seq.adapter:
                adapters.add(seq.adapter)
            budget -= self._add_chunk(out, seq, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        for seq in list(self.running.values()):  # oldest first
            if seq.request_id not in self.running or not seq.is_prefilled:
                continue
            while not self.kv.grow(seq.request_id, seq.num_tokens):
                victim = self._victim()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim in out.decodes:  # an older one of lower priority, already scheduled
                    out.decodes.remove(victim)
                if victim is seq:
                    break
            else:
                out.decodes.append(seq)
        spare = None if self.max_num_batched_tokens is None else \
            self.max_num_batched_tokens - len(out.decodes) - self._prompt_tokens_due()
        for seq in out.decodes:
            if spare is not None:
                seq.spec.draft_ids = seq.spec.draft_ids[:max(spare, 0)]
                spare -= len(seq.spec.draft_ids)
            num_draft = len(seq.spec.draft_ids)
            if num_draft and not self.kv.grow(seq.request_id, seq.num_tokens + num_draft):
                seq.spec.draft_ids = []

    def _prompt_tokens_due(self) -> int:
        """Prompt tokens this step would compute with room for them: the rest of running prompts,
        then waiting ones while the batch has room (at most max_prefill_tokens)."""
        due = sum(s.num_prefill_tokens - s.num_computed_tokens for s in self.running.values()
                  if not s.is_prefilled)
        room = self.max_num_seqs - len(self.running)
        for seq in itertools.islice(self.waiting, max(room, 0)):
            if due >= self.max_prefill_tokens:
                break
            due += seq.num_prefill_tokens
        return min(due, self.max_prefill_tokens)

    def _victim(self) -> Sequence:
        """Who is preempted next: the lowest priority, the newest (last admitted) among equals."""
        return min(reversed(self.running.values()), key=lambda s: s.params.priority)

    def _preempt(self, seq: Sequence) -> None:
        """Free the request's blocks; it recomputes prompt + generated tokens when readmitted."""
        del self.running[seq.request_id]
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec.draft_ids = []
        # prefilled next time with the carried-over tokens, then decoding goes on
        seq.num_recomputed_tokens = len(seq.output_ids) - seq.num_carried_over_tokens
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        log.info("preempted %s (%d tokens) for lack of KV blocks; %d preemptions so far",
                 seq.request_id, seq.num_tokens, self.num_preemptions)

    def commit(self, out: SchedulerOutput) -> None:
        """The step `out` ran and its new tokens joined output_ids: their K/V are in the cache,
        and the blocks they filled become findable (after the model ran, so a failed step caches
        nothing). A decode's last output token is never computed yet (the next step feeds it),
        so a verified run counts exactly its accepted proposals, and the blocks reserved for
        rejected ones are released: hashes only ever cover tokens the sequence keeps."""
        for c in out.prefills:
            c.seq.num_computed_tokens = c.start + c.num_tokens
        for s in out.decodes:
            s.num_computed_tokens = s.num_tokens - 1
            self.kv.trim(s.request_id, s.num_tokens)
        for seq in [c.seq for c in out.prefills] + out.decodes:
            self.kv.commit(seq.request_id, seq.num_computed_tokens, seq.prompt_ids, seq.output_ids)

    @staticmethod
    def _add_chunk(out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        start = seq.num_computed_tokens
        n = min(seq.num_prefill_tokens - start, budget)
        out.prefills.append(PrefillChunk(seq, start, n))
        return n

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence (stopped, aborted or failed) and free its blocks at once."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.running.pop(seq.request_id, None)
        try:
            self.waiting.remove(seq)
        except ValueError:
            pass
        self.kv.free(seq.request_id)

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is not None:
            return seq
        return next((s for s in self.waiting if s.request_id == request_id), None)
