"""Owns every tensor: builds forward batches, runs the model, samples.

One call per engine step: the prompts of newly admitted sequences (packed
into one row, no padding) and one decode token for every running sequence,
then one sampler call over all their logits and one host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.sampling import Sampler, SamplerOutput, SamplingRow, build_sampling_batch
from worker.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    is_finite: bool  # False: the row's logits had NaN/inf and the request must fail
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.sampler = Sampler()

    def run(self, prefills: list[Sequence], decodes: list[Sequence]) -> list[SampledToken]:
        """Sample the next token of every sequence; results in order prefills + decodes."""
        logits = []
        if prefills:
            logits.append(self._prefill(prefills))
        if decodes:
            logits.append(self._decode(decodes))
        all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # (B, V); no copy in pure decode
        seqs = prefills + decodes
        rows = [SamplingRow(params=s.params, seed=s.seed, prompt_token_ids=s.prompt_ids,
                            output_token_ids=s.output_ids) for s in seqs]
        batch = build_sampling_batch(rows, all_logits.shape[-1], self.device)
        return self._to_host(self.sampler(all_logits, batch))

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """All new prompts packed into one row: no padding, one big matmul per weight."""
        prefill_ids = [s.prefill_ids for s in seqs]
        lengths = [len(ids) for ids in prefill_ids]
        ids = torch.tensor([t for p in prefill_ids for t in p], device=self.device)  # (T,)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])  # (T,)
        token_slots = torch.tensor([s.slot for s, n in zip(seqs, lengths, strict=True) for _ in range(n)],
                                   device=self.device)  # (T,)
        batch = ForwardBatch(
            input_ids=ids[None], positions=positions[None],
            slot_ids=torch.tensor([seqs[0].slot], device=self.device), kv_len=max(lengths),
            segment_bounds=(0, *itertools.accumulate(lengths)), token_slots=token_slots[None],
        )
        logits = self.model.forward(batch, self.cache)  # (S, V)
        for s, n in zip(seqs, lengths, strict=True):
            s.num_computed_tokens = n
        return logits

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        last = [s.output_ids[-1] for s in seqs]
        pos = [s.num_tokens - 1 for s in seqs]
        slots = [s.slot for s in seqs]
        batch = ForwardBatch(
            input_ids=torch.tensor(last, device=self.device)[:, None],  # (B, 1)
            positions=torch.tensor(pos, device=self.device)[:, None],  # (B, 1)
            slot_ids=torch.tensor(slots, device=self.device), kv_len=max(pos) + 1,
            slot_range=_as_range(slots), needs_mask=len(set(pos)) > 1,
        )
        logits = self.model.forward(batch, self.cache)  # (B, V)
        for s in seqs:
            s.num_computed_tokens = s.num_tokens
        return logits

    @staticmethod
    def _to_host(out: SamplerOutput) -> list[SampledToken]:
        ids = out.token_ids.tolist()  # the step's one host sync (plus logprobs when asked)
        finite = out.is_finite.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        tokens = []
        for i, tok in enumerate(ids):
            top = list(zip(top_ids[i], top_lps[i], strict=True)) if top_ids and top_lps else None
            tokens.append(SampledToken(tok, bool(finite[i]), lps[i] if lps else None, top))
        return tokens


def _as_range(slots: list[int | None]) -> slice | None:
    """slots == [a, a+1, ..., b-1] → slice(a, b): the cache is then read as a view."""
    first = slots[0]
    if first is not None and slots == list(range(first, first + len(slots))):
        return slice(first, first + len(slots))
    return None
