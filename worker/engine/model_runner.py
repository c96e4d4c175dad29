"""Owns every tensor: builds the step's flattened batch, runs the model, samples.

One forward per engine step, whatever it holds: this step's prompt chunks and
one decode token for every running sequence, flattened into one list of new tokens with
vLLM-style attention metadata (`ForwardBatch`; on CUDA in the persistent buffers of
input_batch.py), so the weights are read once per step. Then one sampler call over the rows
that get a token (completed prompts and decodes) and one host sync for the token ids.

A decode with k proposals is one sequence of k + 1 tokens (its last token, then each
proposal), as a prompt chunk is: the scheduler's num_scheduled_tokens, one query over its
context (FlashInfer and the torch backend take it whole). Every layer writes all new K/V
before any row attends, so that is causal attention; the C kernels run each of its tokens
as a decode row (attention.rows_as_decodes), the path plain decodes take, so a verified token
is computed bit for bit as plain decoding computes it. Token j's sampling history is the
output plus the proposals before it: it draws the target's own output token len(output) + j
with that index's noise and penalties.

A sequence with a LoRA adapter gives each of its rows the adapter's slot in the step: the
step's distinct adapters in order of first appearance (`ForwardBatch.adapters`), at most the
scheduler's max_adapters.

Rows of constrained sequences (a response_format) get their grammar's mask before sampling
(grammar.fill_masks, on a thread of its own while the model computes, then apply_bitmask; a
decode's proposal rows the masks of its matcher advanced through them).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker.engine.adapters import AdapterRegistry
from worker.engine.grammar import apply_bitmask, fill_masks
from worker.engine.input_batch import BatchBuilder, InputBatch
from worker.engine.kv_manager import KVCacheManager
from worker.engine.penalties import PenaltyCounts
from worker.engine.sampling import ParamStaging, Sampler, SamplerOutput, SamplingRow
from worker.engine.sequence import PrefillChunk, Sequence, sampled_sequences
from worker.model.llama import ForwardBatch, KVCache, LlamaModel
from worker.model.lora import LoraAdapter
from worker.model.static_decode import StaticDecode


@dataclass
class Query:
    """One sequence's part of a step: `tokens` at positions start.., logits for the last
    `num_logits` of them, through LoRA adapter `adapter` ("" = the base model)."""

    request_id: str
    tokens: list[int]
    start: int
    num_logits: int
    adapter: str = ""


@dataclass
class SampledToken:
    token_id: int
    is_finite: bool  # False: the row's logits had NaN/inf and the request must fail
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, kv: KVCacheManager,
                 adapters: AdapterRegistry | None = None, static: StaticDecode | None = None,
                 persistent_inputs: bool | None = None, max_num_seqs: int = 4) -> None:
        """static: decode-only steps through its buffers (CUDA graphs), else every step dynamic.
        persistent_inputs: a dynamic step's tensors in InputBatch's buffers, and the sampling
        parameters in buffers of their own (default: on CUDA). max_num_seqs: the most requests a
        step runs (sizes the kept penalty counts on CUDA).
        On CPU the step's fresh tensors cost less: in a SmolLM2 batch-1 step, after the forward
        has streamed the weights through the caches, InputBatch.build took 73-82 us and the list
        builder's torch.tensor calls 34 (2-core Zen 4, 2026-12-06; 12.5 vs 23 us back to back),
        and there is no device copy to save."""
        self.model = model
        self.cache = cache
        self.static = static
        self.kv = kv
        self.adapters = adapters  # None: LoRA is off
        self.device = model.device
        if persistent_inputs is None:
            persistent_inputs = model.device.type == "cuda"
        self.inputs = InputBatch(model.device) if persistent_inputs else None
        # Penalty counts kept per request across steps (penalties.py; on CUDA allocated whole,
        # max_num_seqs rows, which the memory plan counts), the sampling parameters in buffers
        # allocated once where the step's inputs are, and on CUDA the race fused into one kernel.
        cuda = model.device.type == "cuda"
        kept = PenaltyCounts(model.config.vocab_size, model.device, max_num_seqs if cuda else 4)
        staging = ParamStaging.on(model.device) if persistent_inputs else None
        self.sampler = Sampler(model.greedy_argmax, kept, staging, fused=cuda)
        self.mask_seconds = 0.0  # what masking the constrained rows took in the last step
        # Grammar masks are filled here while the model computes: they depend only on the tokens
        # already accepted (xgrammar releases the GIL).
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def run(self, prefills: list[PrefillChunk], decodes: list[Sequence]) -> list[list[SampledToken]]:
        """Compute the chunks and decodes; sample the next token of every sequence whose
        prompt completes this step, then of every decode: results in that order, one token
        each, or for a decode with k proposals the target's token at each of k + 1 positions."""
        seqs = sampled_sequences(prefills, decodes)
        drafts: list[list[int]] = [[] for c in prefills if c.is_last] + [s.spec.draft_ids for s in decodes]
        masks = self._fill_masks(seqs, drafts)  # on the mask thread while the model computes
        logits = self.forward(self._queries(prefills, decodes), len(prefills))  # (R, V)
        if not seqs:
            return []  # only partial prompt chunks ran
        rows = [SamplingRow(params=s.params, seed=s.seed, prompt_token_ids=s.prompt_ids,
                            output_token_ids=s.output_ids + draft[:j], owner=s,
                            num_accepted=len(s.output_ids))
                for s, draft in zip(seqs, drafts, strict=True) for j in range(1 + len(draft))]
        if masks is not None:
            start = time.perf_counter()
            bitmask, masked = masks.result()
            assert bitmask.shape[0] == logits.shape[0], "a mask row for every sampled row"
            apply_bitmask(logits, bitmask, masked)
            self.mask_seconds += time.perf_counter() - start
        flat = self._to_host(self.sampler.sample(logits, rows, self.device))
        out, i = [], 0
        for draft in drafts:
            out.append(flat[i:i + 1 + len(draft)])
            i += 1 + len(draft)
        return out

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget the per-request state of requests not in `request_ids` (finished or preempted)."""
        assert self.sampler.kept is not None
        self.sampler.kept.retain(request_ids)

    def _fill_masks(self, seqs: list[Sequence], drafts: list[list[int]],
                    ) -> Future[tuple[torch.Tensor, list[int]]] | None:
        """Start filling the grammar masks of the constrained sequences' rows; None: no row is
        constrained. mask_seconds: the fill's time (set on the mask thread), then the apply's."""
        constrained, first_row = [], 0
        for seq, draft in zip(seqs, drafts, strict=True):
            if seq.constraint is not None:
                constrained.append((first_row, seq.constraint, draft))
            first_row += 1 + len(draft)
        self.mask_seconds = 0.0
        if not constrained:
            return None

        def fill() -> tuple[torch.Tensor, list[int]]:
            start = time.perf_counter()
            masks = fill_masks(first_row, self.model.config.vocab_size, constrained)
            self.mask_seconds += time.perf_counter() - start
            return masks
        return self._mask_thread.submit(fill)

    def forward(self, queries: list[Query], num_prefills: int) -> torch.Tensor:
        """Logits (R, V) of the queries' logit rows, in order. The first num_prefills queries are
        prompt chunks; a step of decodes alone (each query its last token and its proposals)
        runs through the static buffers when there are any (CUDA graphs), any other step in
        InputBatch's buffers (on CUDA) or in new tensors. The draft proposer's passes come here
        too, through a runner of its own."""
        batch, adapters = self._batch(queries)
        if self.static is not None and num_prefills == 0 and not adapters:
            return self.static.run(batch.ids, batch.positions, batch.slots, batch.row_tables())
        if self.inputs is not None:
            return self.model.forward(self.inputs.build(batch, num_prefills, adapters), self.cache)
        return self.model.forward(batch.build(num_prefills=num_prefills, adapters=adapters), self.cache)

    def prepare(self, prefills: list[PrefillChunk], decodes: list[Sequence]) -> ForwardBatch:
        """The flattened batch: every chunk's tokens, then each decode's last token and its
        proposals, one row each (in new tensors, where a CUDA step's are views of InputBatch's)."""
        batch, adapters = self._batch(self._queries(prefills, decodes))
        return batch.build(num_prefills=len(prefills), adapters=adapters)

    @staticmethod
    def _queries(prefills: list[PrefillChunk], decodes: list[Sequence]) -> list[Query]:
        """Each chunk's tokens (logits at a prompt's last), then each decode: its last token and
        the proposals it verifies, logits at every one."""
        queries = [Query(c.seq.request_id, c.seq.prefill_ids[c.start:c.start + c.num_tokens], c.start,
                         int(c.is_last), c.seq.adapter) for c in prefills]
        for s in decodes:
            tokens = s.output_ids[-1:] + s.spec.draft_ids
            queries.append(Query(s.request_id, tokens, s.num_tokens - 1, len(tokens), s.adapter))
        return queries

    def _batch(self, queries: list[Query]) -> tuple[BatchBuilder, tuple[LoraAdapter, ...]]:
        batch = BatchBuilder(self.kv.block_size, self.device)
        slots: dict[str, int] = {}  # adapter name -> its slot in this step
        for q in queries:
            slot = slots.setdefault(q.adapter, len(slots)) if q.adapter else -1
            batch.add(self.kv.block_table(q.request_id), q.tokens, q.start, q.num_logits, slot, q.request_id,
                      self.kv.table_version(q.request_id))
        if slots and self.adapters is None:
            raise ValueError("a sequence names a LoRA adapter but this engine has LoRA off")
        adapters = tuple(self.adapters.get(name) for name in slots) if self.adapters else ()
        return batch, adapters

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
