"""Owns every tensor: builds forward batches, runs the model, samples.

One call per engine step: the prompts of newly admitted sequences (grouped into
padded batches of similar length) and one decode token for every running
sequence, then one sampler call over all their logits and one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.sampling import Sampler, SamplingRow, build_sampling_batch
from worker.sequence import Sequence

# Prompts are batched together while padding wastes at most this fraction.
MAX_PADDING_WASTE = 0.25


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
        groups = group_prompts(prefills)
        logits = [self._prefill(group) for group in groups]
        if decodes:
            logits.append(self._decode(decodes))
        seqs = [s for group in groups for s in group] + decodes
        all_logits = torch.cat(logits)  # (B, V)
        rows = [SamplingRow(params=s.params, seed=s.seed, prompt_token_ids=s.prompt_ids,
                            output_token_ids=s.output_ids) for s in seqs]
        batch = build_sampling_batch(rows, all_logits.shape[-1], self.device)
        out = self.sampler(all_logits, batch)
        order = {id(s): i for i, s in enumerate(seqs)}
        tokens = self._to_host(out)
        return [tokens[order[id(s)]] for s in prefills + decodes]

    def _prefill(self, group: list[Sequence]) -> torch.Tensor:
        lengths = [len(s.prompt_ids) for s in group]
        t = max(lengths)
        ids = torch.tensor([s.prompt_ids + [0] * (t - len(s.prompt_ids)) for s in group],
                           device=self.device)  # (B, T) right-padded
        positions = torch.arange(t, device=self.device).expand(len(group), t)  # (B, T)
        slots = [s.slot for s in group]
        batch = ForwardBatch(
            input_ids=ids, positions=positions,
            slot_ids=torch.tensor(slots, device=self.device), kv_len=t,
            slot_range=_as_range(slots),
            last_index=torch.tensor([n - 1 for n in lengths], device=self.device),
            is_fresh_prefill=len(set(lengths)) == 1,  # no padding: causal over new tokens is exact
        )
        logits = self.model.forward(batch, self.cache)  # (B, V)
        for s in group:
            s.num_computed_tokens = len(s.prompt_ids)
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
    def _to_host(out) -> list[SampledToken]:  # type: ignore[no-untyped-def]
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


def group_prompts(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Group prompts of similar length (sorted) so padding stays cheap."""
    groups: list[list[Sequence]] = []
    for s in sorted(seqs, key=lambda s: len(s.prompt_ids)):
        if groups:
            g = groups[-1]
            n = len(g) + 1
            padded = n * len(s.prompt_ids)
            real = sum(len(x.prompt_ids) for x in g) + len(s.prompt_ids)
            if padded <= real * (1 + MAX_PADDING_WASTE):
                g.append(s)
                continue
        groups.append([s])
    return groups


def _as_range(slots: list[int | None]) -> slice | None:
    """slots == [a, a+1, ..., b-1] → slice(a, b): the cache is then read as a view."""
    first = slots[0]
    if first is not None and slots == list(range(first, first + len(slots))):
        return slice(first, first + len(slots))
    return None
