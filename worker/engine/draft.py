"""Proposals from a draft model (`--speculative draft --draft-model PATH`).

A smaller model with the target's tokenizer runs in the same worker, with its own paged KV
cache and block manager (prefix caching off: its blocks are only ever this worker's working
copy). Each step it drafts k tokens for every speculating sequence in k forward passes over
all of them at once:

  pass 1: the tokens the draft has not computed yet (the whole prompt the first time, then
          what the last verification accepted plus the target's token) as one chunk per
          sequence, logits at the last token -> draft token 1;
  pass j: draft token j - 1 as one decode row -> draft token j.

Draft token j is sampled as the target samples its output token len(output) + j - 1: the same
SamplingParams, the same counter-based noise for that index and the same history (output +
drafts before it), so a draft that agrees with the target draws the target's token even for a
seeded, non-greedy request ("coupled" drafting; vLLM's probabilistic acceptance would accept
other tokens and change the seeded answer). Verification (core.py) keeps the output that of
plain decoding whatever the draft says.

The draft's K/V are kept between steps. Before drafting, each sequence's cached tokens are
compared with its current prompt + output: what a rejection made stale (the draft's own
tokens past the first mismatch) is trimmed, so there is no rollback to get wrong and a
sequence the scheduler left out of a step, or that stopped speculating for a while, simply
catches up. A sequence that does not fit in the draft's pool, or needs more catching up than
`max_prefill_tokens` leaves this step, proposes nothing (it never preempts anything).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from worker.engine.kv_manager import KVCacheManager
from worker.engine.model_runner import ModelRunner, Query
from worker.engine.sampling import SamplingRow
from worker.engine.sequence import Sequence
from worker.model.llama import KVCache, LlamaModel
from worker.model.static_decode import StaticDecode


@dataclass
class _Cached:
    token_ids: list[int] = field(default_factory=list)  # whose K/V the draft holds, positions 0..


@dataclass
class _Job:
    seq: Sequence
    k: int
    history: list[int]  # prompt + output
    inputs: list[int] = field(default_factory=list)  # this pass's tokens, from `position` on
    position: int = 0
    drafts: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(self, model: LlamaModel, cache: KVCache, kv: KVCacheManager,
                 max_prefill_tokens: int, static: StaticDecode | None = None, max_num_seqs: int = 4) -> None:
        """static: the draft's decode passes through its buffers (CUDA graphs), as the target's."""
        # The draft's passes run as the target's steps do (persistent inputs and CUDA graphs on
        # CUDA, penalty counts kept per request), through a model runner of the draft's own.
        self.runner = ModelRunner(model, cache, kv, static=static, max_num_seqs=max_num_seqs)
        self.kv = kv
        self.max_prefill_tokens = max_prefill_tokens
        self._cached: dict[str, _Cached] = {}

    def retain(self, request_ids: Iterable[str]) -> None:
        keep = set(request_ids)
        for request_id in [r for r in self._cached if r not in keep]:
            self.release(request_id)
        self.runner.retain(keep)

    def release(self, request_id: str) -> None:
        self._cached.pop(request_id, None)
        self.kv.free(request_id)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        jobs = [_Job(s, k, s.prompt_ids + s.output_ids) for s, k in zip(seqs, ks, strict=True)]
        budget, ready = self.max_prefill_tokens, []
        for job in jobs:
            start = self._reuse(job)
            if start is None or budget == 0:
                continue
            if not self.kv.grow(job.seq.request_id, len(job.history) + job.k - 1):
                self.release(job.seq.request_id)  # no room this step: catch up later
                continue
            job.inputs = job.history[start:start + budget]
            job.position = start
            if len(job.inputs) < len(job.history) - start:
                job.k = 0  # a long way behind: catch up over several steps, no drafts yet
            budget -= len(job.inputs)
            ready.append(job)
        if ready:
            self._draft(ready)
        return [job.drafts for job in jobs]

    def _reuse(self, job: _Job) -> int | None:
        """Trim the sequence's draft K/V to what still matches its tokens; the first position
        to compute (at least the last token: its logits give the first draft), or None when
        no block is free for a new sequence."""
        request_id, history = job.seq.request_id, job.history
        cached = self._cached.get(request_id)
        if cached is None:
            if self.kv.allocate(request_id, history, scope=job.seq.cache_scope) is None:
                return None
            self._cached[request_id] = _Cached()
            return 0
        old, n = cached.token_ids, min(len(cached.token_ids), len(history) - 1)
        if old[:n] != history[:n]:  # a rejected draft: find the first stale position
            n = next(i for i in range(n) if old[i] != history[i])
        del old[n:]
        self.kv.trim(request_id, n)
        return n

    def _draft(self, jobs: list[_Job]) -> None:
        """Up to k passes over the jobs: each job's drafts, and the K/V of every token it
        inputs (all but its last draft) in the cache."""
        for j in range(max(1, *(job.k for job in jobs))):
            active = [job for job in jobs if job.k > j or j == 0]
            queries = [Query(job.seq.request_id, job.inputs, job.position, int(job.k > 0)) for job in active]
            logits = self.runner.forward(queries, num_prefills=len(active) if j == 0 else 0)  # (R, V)
            for job in active:
                self._cached[job.seq.request_id].token_ids.extend(job.inputs)
                job.position += len(job.inputs)
            drafting = [job for job in active if job.k > 0]
            if not drafting:
                return
            rows = [SamplingRow(job.seq.params, job.seq.seed, job.seq.prompt_ids,
                                job.seq.output_ids + job.drafts, owner=job.seq,
                                num_accepted=len(job.seq.output_ids)) for job in drafting]
            out = self.runner.sampler.sample(logits, rows, self.runner.device)
            for job, token_id in zip(drafting, out.token_ids.tolist(), strict=True):
                job.inputs = [token_id]
                job.drafts.append(token_id)
