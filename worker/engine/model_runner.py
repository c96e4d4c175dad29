"""Owns every tensor: builds forward batches, runs the model, samples.

One call per engine step: this step's prompt chunks (packed into one row, no
padding) and one decode token for every running sequence. With the CPU decode
kernel both go through one forward (decode tokens at the end of the packed row),
so the weights are read once per step; otherwise prompts and decodes are two
forwards. Then one sampler call over the rows that get a token (completed prompts
and decodes) and one host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import torch

from worker.engine.sampling import Sampler, SamplerOutput, SamplingRow, build_sampling_batch
from worker.engine.sequence import PrefillChunk, Sequence, sampled_sequences
from worker.model.llama import ForwardBatch, KVCache, LlamaModel


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
        # Prompt chunks and decodes in one forward where decode attention can run on the
        # packed row (the CPU kernel); else two forwards, the weights read twice.
        self.enable_mixed_steps = model.native_decode is not None

    def run(self, prefills: list[PrefillChunk], decodes: list[Sequence]) -> list[SampledToken]:
        """Compute the chunks and decodes; sample the next token of every sequence whose
        prompt completes this step, then of every decode: results in that order."""
        logits = []
        if prefills and decodes and self.enable_mixed_steps:
            logits.append(self._prefill(prefills, decodes))  # one forward: weights read once
        else:
            if prefills:
                logits.append(self._prefill(prefills))
            if decodes:
                logits.append(self._decode(decodes))
        seqs = sampled_sequences(prefills, decodes)
        if not seqs:
            return []  # only partial prompt chunks ran
        all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)  # (B, V); no copy in pure decode
        rows = [SamplingRow(params=s.params, seed=s.seed, prompt_token_ids=s.prompt_ids,
                            output_token_ids=s.output_ids) for s in seqs]
        batch = build_sampling_batch(rows, all_logits.shape[-1], self.device)
        return self._to_host(self.sampler(all_logits, batch))

    def _prefill(self, chunks: list[PrefillChunk], decodes: list[Sequence] | None = None) -> torch.Tensor:
        """All prompt chunks packed into one row: no padding, one big matmul per weight.
        Decodes, if given, ride at the end of the same row (one token each).

        Returns the logits of the last token of each chunk that completes its prompt,
        then of each decode.
        """
        decodes = decodes or []
        token_ids = [c.seq.prefill_ids[c.start:c.start + c.num_tokens] for c in chunks]
        token_ids.append([s.output_ids[-1] for s in decodes])
        lengths = [c.num_tokens for c in chunks]
        slots = [c.seq.slot for c in chunks]
        decode_slots = [s.slot for s in decodes]
        assert None not in slots + decode_slots, "the scheduler gives every running sequence a slot"
        ids = torch.tensor([t for p in token_ids for t in p], device=self.device)  # (T,)
        positions = torch.tensor([p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
                                 + [s.num_tokens - 1 for s in decodes], device=self.device)  # (T,)
        token_slots = torch.tensor([s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
                                   + decode_slots, device=self.device)  # (T,)
        starts = tuple(c.start for c in chunks)
        batch = ForwardBatch(
            input_ids=ids[None], positions=positions[None],
            slot_ids=torch.tensor([slots[0]], device=self.device),
            kv_len=max(c.start + c.num_tokens for c in chunks),
            segment_bounds=(0, *itertools.accumulate(lengths)), token_slots=token_slots[None],
            segment_starts=starts if any(starts) else None,
            segment_slots=tuple(cast(list[int], slots)),
            decode_slot_ids=torch.tensor(decode_slots, device=self.device) if decodes else None,
        )
        logits = self.model.forward(batch, self.cache)  # (num_chunks + num_decodes, V)
        for c in chunks:
            c.seq.num_computed_tokens = c.start + c.num_tokens
        for s in decodes:
            s.num_computed_tokens = s.num_tokens
        done = [i for i, c in enumerate(chunks) if c.is_last] + list(range(len(chunks), len(logits)))
        return logits if len(done) == len(logits) else logits[done]

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
