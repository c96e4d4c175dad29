"""Who runs next: admit waiting requests into free KV cache slots (no torch).

Each step runs every prefilled sequence for one decode token, plus up to
`max_prefill_tokens` prompt tokens: first the next chunk of prompts already
being prefilled, then the prompts of newly admitted sequences (FIFO, while
slots are free). A prompt longer than what is left of the budget is prefilled
in chunks over several steps (chunked prefill), so neither a burst of prompts
nor one very long prompt stalls the running streams for more than one budget's
worth of compute per step. A request that does not fit waits; it is never
dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from protos.params import FinishReason
from worker.engine.kv_cache import KVCacheManager
from worker.engine.sequence import PrefillChunk, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)  # prompt chunks run this step
    decodes: list[Sequence] = field(default_factory=list)  # one token each, sorted by slot

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_prefill_tokens: int) -> None:
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.kv.max_len:
            raise ValueError(f"sequence of {seq.num_tokens} tokens exceeds max_model_len {self.kv.max_len}")
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.decodes = sorted((s for s in self.running.values() if s.is_prefilled),
                             key=lambda s: s.slot if s.slot is not None else -1)
        budget = self.max_prefill_tokens
        for seq in self.running.values():  # admission order: older prompts finish first
            if budget > 0 and not seq.is_prefilled:
                budget -= self._add_chunk(out, seq, budget)
        while budget > 0 and self.waiting and self.kv.can_allocate(self.waiting[0].num_tokens):
            seq = self.waiting.popleft()
            seq.slot, seq.num_cached_tokens = self.kv.allocate(seq.request_id, seq.prefill_ids)
            seq.num_computed_tokens = seq.num_cached_tokens  # prefill starts after the cached prefix
            seq.status = SequenceStatus.RUNNING
            seq.admitted_time = time.time()
            self.running[seq.request_id] = seq
            budget -= self._add_chunk(out, seq, budget)
        return out

    @staticmethod
    def _add_chunk(out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        start = seq.num_computed_tokens
        n = min(seq.num_prefill_tokens - start, budget)
        out.prefills.append(PrefillChunk(seq, start, n))
        return n

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence (stopped, aborted or failed) and free its slot at once."""
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
        # what the slot's K/V now hold: every token already fed through the model
        self.kv.free(seq.request_id, (seq.prompt_ids + seq.output_ids)[:seq.num_computed_tokens])
        seq.slot = None

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is not None:
            return seq
        return next((s for s in self.waiting if s.request_id == request_id), None)
