"""The engine core: token ids in, token ids out (no Redis, no text).

`step()` = apply aborts → propose → schedule → run the model → accept. Aborts
are collected between steps (thread-safe) and applied at the start of the next,
so an aborted request frees its KV blocks within one step. `_accept` is the one
place a step's tokens join their sequences: append, stop checks (the text-level
stop a TextEngine attaches included), commit, free the finished; only after the
model has run does the scheduler count the step's tokens as computed and hash
the blocks they filled (`Scheduler.commit`: a failed step caches nothing).

With speculation on (`num_speculative_tokens` > 0), a running sequence may get
proposals (n-gram, or a draft model's) before scheduling; the runner returns the
target's token at each of its k + 1 positions, and accept keeps the accepted
proposals plus the target's next token (one EngineOutput per token, a stop inside
the run drops the rest); commit then advances the computed-token count by what
was kept and hands the blocks reserved past it back (speculative.py explains why
the output is the same as without). The step's seconds and its rows feed the
policy's cost model (spec_policy.py).

A request with a response_format (grammar.py) waits outside the scheduler until its format is
compiled (on a background thread), then joins the queue with its matcher fed the tokens it
already has; the runner masks its rows, and accept advances its matcher with each kept token.
A compile error fails only that request (`Sequence.is_invalid_request`: INVALID_ARGUMENT).

With LoRA (`max_adapters` > 0) a request may name an adapter (`adapters`: AdapterRegistry);
an adapter being unloaded is freed at the end of the first step that leaves it no sequence.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass

import torch

from protos.params import FinishReason, SamplingParams
from worker.engine.adapters import AdapterRegistry
from worker.engine.grammar import Constraint, GrammarCompiler
from worker.engine.kv_manager import KVCacheManager
from worker.engine.model_runner import ModelRunner, SampledToken
from worker.engine.outputs import context_overflow
from worker.engine.scheduler import Scheduler, SchedulerOutput
from worker.engine.sequence import Sequence, sampled_sequences
from worker.engine.spec_policy import SpeculationPolicy
from worker.engine.speculative import NgramProposer, Proposer, num_accepted
from worker.engine.stopping import StoppingCriteria
from worker.model.llama import LlamaModel
from worker.model.lora import DEFAULT_MAX_LORA_RANK
from worker.model.static_decode import StaticDecode

# How long an idle engine waits for a compiling format before its caller's loop goes on.
COMPILE_WAIT_S = 0.05


@dataclass
class EngineOutput:
    """One token one step produced for one request (a verified run gives several, in order)."""

    seq: Sequence
    token: SampledToken | None  # None when the request ended without a new token (abort, error)
    finish_reason: FinishReason | None = None  # set on a request's last output
    error: str | None = None  # set with FinishReason.ERROR


class EngineCore:
    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_prefill_tokens: int, eos_token_ids: frozenset[int],
                 kv_cache_dtype: torch.dtype | None = None, enable_prefix_caching: bool = True,
                 num_speculative_tokens: int = 0, proposer: Proposer | None = None,
                 grammar: GrammarCompiler | None = None, max_adapters: int = 0,
                 max_lora_rank: int = DEFAULT_MAX_LORA_RANK, static_decode: bool = False,
                 cuda_graphs: bool = False, max_num_batched_tokens: int | None = None) -> None:
        """max_num_batched_tokens: all tokens a step computes (scheduler.py); None: prompt tokens
        are bounded by max_prefill_tokens alone.
        max_adapters: most distinct LoRA adapters per step; 0 = LoRA off (the model must have
        enable_lora otherwise). static_decode: decode-only steps through buffers allocated once
        (worker/model/static_decode.py), with a CUDA graph per bucket when cuda_graphs; the cache
        then has one more block than the pool, the padding rows' scratch."""
        self.model = model
        self.max_len = max_model_len
        self.eos_token_ids = eos_token_ids
        static_decode = static_decode or cuda_graphs
        cache = model.new_cache(num_blocks + int(static_decode), block_size, kv_cache_dtype)
        self.kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs, max_prefill_tokens, max_adapters or None,
                                   max_num_batched_tokens)
        # None: LoRA off, and a request naming an adapter is refused
        self.adapters = AdapterRegistry(model, max_adapters, max_lora_rank) if max_adapters > 0 else None
        static = (StaticDecode(model, cache, max_num_seqs * (1 + num_speculative_tokens),
                               -(-max_model_len // block_size), capture=cuda_graphs)
                  if static_decode else None)
        self.runner = ModelRunner(model, cache, self.kv, self.adapters, static, max_num_seqs=max_num_seqs)
        self.num_step_prefill_tokens = self.num_step_decode_tokens = 0  # what the last step computed
        # None: no speculation. Counts since start: verified runs, proposed and accepted tokens.
        self.spec = SpeculationPolicy(num_speculative_tokens) if num_speculative_tokens > 0 else None
        self.proposer: Proposer = proposer or NgramProposer()
        self.num_spec_drafts = self.num_spec_draft_tokens = self.num_spec_accepted_tokens = 0
        self.grammar = grammar  # None: response_format is refused (the structured extra is missing)
        self.compiling: list[Sequence] = []  # constrained sequences whose format is not compiled yet
        self._aborts: set[str] = set()
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, seed: int | None = None,
                    resume_ids: Seq[int] = (), cache_scope: bytes = b"", adapter: str = "") -> Sequence:
        """Queue a request. `seed` overrides params.seed (a resumed request keeps its
        first worker's seed); `resume_ids` are tokens an earlier worker already generated;
        `cache_scope` decides whose cached prompt blocks it may share (equal scopes only);
        `adapter`: the LoRA adapter it runs with ("" = the base model)."""
        seq = self.new_sequence(request_id, prompt_ids, params, arrival_time, seed=seed,
                                resume_ids=resume_ids, cache_scope=cache_scope, adapter=adapter)
        self.submit(seq)
        return seq

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence built by `new_sequence`."""
        if len(seq.output_ids) >= seq.params.max_tokens:
            raise ValueError(f"resumed request {seq.request_id!r} already has max_tokens "
                             f"({seq.params.max_tokens}) tokens")
        if seq.constraint is not None and not seq.constraint.is_ready:
            self.compiling.append(seq)  # the scheduler gets it once compiled (_admit_compiled)
            return
        if seq.constraint is not None and not seq.constraint.start(seq.output_ids):
            raise ValueError(seq.constraint.error)  # a format known not to compile (cached)
        self.scheduler.add(seq)

    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     arrival_time: float | None = None, *, seed: int | None = None,
                     resume_ids: Seq[int] = (), cache_scope: bytes = b"", adapter: str = "") -> Sequence:
        """A validated Sequence, not queued (`add_request` queues it)."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if adapter:
            if self.adapters is None:
                raise ValueError(f"adapter {adapter!r}: this worker serves no LoRA adapters (LoRA is off)")
            self.adapters.check(adapter)
            cache_scope = self.adapters.cache_scope(adapter, cache_scope)  # shares blocks with its own only
        if self.scheduler.find(request_id) is not None or self._find_compiling(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already running")
        if len(prompt_ids) + params.max_tokens > self.max_len:
            raise context_overflow(len(prompt_ids), params.max_tokens, self.max_len)
        if len(prompt_ids) + params.max_tokens > self.kv.max_num_tokens:  # a small pool, not the context
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the KV cache of this worker ({self.kv.num_blocks} blocks of "
                             f"{self.kv.block_size} tokens); lower max_tokens")
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Sequence(request_id=request_id, prompt_ids=list(prompt_ids), params=params, seed=seed,
                        stopping=StoppingCriteria(params, self.eos_token_ids, params.max_tokens),
                        cache_scope=cache_scope, adapter=adapter,
                        arrival_time=arrival_time if arrival_time is not None else time.time(),
                        output_ids=list(resume_ids), num_carried_over_tokens=len(resume_ids),
                        constraint=self._constraint(params))

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """The request's format, compiling (or compiled: a cache hit) on the grammar thread."""
        if params.response_format is None:
            return None
        if self.grammar is None:
            raise ValueError("response_format: this worker has no grammar compiler (its structured "
                             "extra, xgrammar, is not installed)")
        return Constraint(self.grammar.compile(params.response_format))

    def _find_compiling(self, request_id: str) -> Sequence | None:
        return next((s for s in self.compiling if s.request_id == request_id), None)

    def _admit_compiled(self, wait_s: float) -> list[EngineOutput]:
        """Queue the sequences whose format is compiled now; fail those whose format does not
        compile. Waits up to wait_s for one (the engine is idle otherwise)."""
        if not self.compiling:
            return []
        if wait_s > 0 and not any(s.constraint.is_ready for s in self.compiling if s.constraint):
            wait_for_futures([s.constraint.future for s in self.compiling if s.constraint], timeout=wait_s,
                             return_when=FIRST_COMPLETED)
        outputs = []
        for seq in [s for s in self.compiling if s.constraint is not None and s.constraint.is_ready]:
            self.compiling.remove(seq)
            assert seq.constraint is not None
            if seq.constraint.start(seq.output_ids):
                self.scheduler.add(seq)
            else:
                seq.is_invalid_request = True
                self.scheduler.finish(seq, FinishReason.ERROR, seq.constraint.error)
                outputs.append(EngineOutput(seq, None, FinishReason.ERROR, seq.constraint.error))
        return outputs

    def abort(self, request_id: str) -> None:
        """Thread-safe; takes effect at the start of the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborts) or bool(self.compiling)

    def unload_adapter(self, name: str) -> None:
        """Refuse new requests of LoRA adapter `name` now; free its weights once no sequence uses it."""
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: this worker serves no LoRA adapters (LoRA is off)")
        self.adapters.unload(name, self._adapters_in_use())

    def _adapters_in_use(self) -> set[str]:
        sched = self.scheduler
        return {s.adapter for s in (*sched.running.values(), *sched.waiting, *self.compiling) if s.adapter}

    def step(self) -> list[EngineOutput]:
        outputs = self._step()
        if self.adapters is not None and self.adapters.is_unloading:
            self.adapters.release_unused(self._adapters_in_use())
        return outputs

    def _step(self) -> list[EngineOutput]:
        outputs = self._apply_aborts()
        outputs += self._admit_compiled(wait_s=0.0 if self.scheduler.has_unfinished() else COMPILE_WAIT_S)
        self._propose()
        sched = self.scheduler.schedule()
        self.num_step_prefill_tokens = sum(c.num_tokens for c in sched.prefills)
        self.num_step_decode_tokens = sum(1 + len(s.spec.draft_ids) for s in sched.decodes)
        if sched.is_empty:
            return outputs
        start = time.perf_counter()
        targets = self.runner.run(sched.prefills, sched.decodes)
        if self.spec is not None and not sched.prefills:  # what the policy weighs proposals with
            self.spec.record_step(self.num_step_decode_tokens, time.perf_counter() - start)
        return outputs + self._accept(sched, targets)

    def _propose(self) -> None:
        """This step's proposals for the running decodes (see SpeculationPolicy for who gets any)."""
        decodes = [s for s in self.scheduler.running.values() if s.is_prefilled]
        for seq in decodes:
            seq.spec.draft_ids = []
        if self.spec is None or not self.spec.is_step_enabled(len(decodes)):
            return
        # Every emitted token counts against max_tokens: at most max_tokens - 1 proposals
        # plus the target's own token (which also keeps positions inside the context).
        ks = [min(self.spec.num_proposals(s.spec, len(decodes)), s.params.max_tokens - len(s.output_ids) - 1)
              for s in decodes]
        seqs = [s for s, k in zip(decodes, ks, strict=True) if k > 0]
        if seqs:
            start = time.perf_counter()
            for seq, draft in zip(seqs, self.proposer.propose(seqs, [k for k in ks if k > 0]), strict=True):
                seq.spec.draft_ids = draft
            self.spec.record_proposals(sum(len(s.spec.draft_ids) for s in seqs), time.perf_counter() - start)

    def _apply_aborts(self) -> list[EngineOutput]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        outputs = []
        for request_id in aborts:
            seq = self.scheduler.find(request_id) or self._find_compiling(request_id)
            if seq in self.compiling:
                self.compiling.remove(seq)
            if seq is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)
                outputs.append(EngineOutput(seq, None, FinishReason.ABORT))
        return outputs

    def _accept(self, sched: SchedulerOutput, targets: list[list[SampledToken]]) -> list[EngineOutput]:
        """Accept what the model sampled this step: the one place a step's tokens join their
        sequences, in this order.

        1. Each sequence that got tokens, in the runner's order (prompts completed by their
           chunk, then the decodes), keeps its accepted proposals and then the target's own
           next token (`_verify`). They are appended one at a time, each followed by the stop
           checks (`_append`); the first stop ends the sequence's run and drops the rest.
        2. `Scheduler.commit`: the kept tokens' K/V count as computed, the blocks they filled
           become findable, and blocks reserved for rejected proposals go back.
        3. The sequences that stopped are finished and their blocks freed (after the commit,
           so the blocks they filled are cached first).
        4. The runner (its kept penalty counts) and the proposer forget whoever no longer runs
           (finished or preempted).

        Returns one EngineOutput per appended token, plus one for a token refused as non-finite.
        """
        now = time.time()
        outputs: list[EngineOutput] = []
        for seq, toks in zip(sampled_sequences(sched.prefills, sched.decodes), targets, strict=True):
            for tok in self._verify(seq, toks):
                outputs.append(self._append(seq, tok, now))
                if outputs[-1].finish_reason is not None:
                    break  # a stop inside an accepted run drops the rest
        self.scheduler.commit(sched)
        for out in outputs:
            if out.finish_reason is not None:
                self.scheduler.finish(out.seq, out.finish_reason, out.error)
        self.runner.retain(self.scheduler.running)
        if self.spec is not None:
            self.proposer.retain(self.scheduler.running)
        return outputs

    def _verify(self, seq: Sequence, toks: list[SampledToken]) -> list[SampledToken]:
        """The target's tokens `seq` keeps: the leading ones its proposals equal, then the target's
        own next one (a plain decode or a prefill keeps its one token); counts the proposals."""
        draft, seq.spec.draft_ids = seq.spec.draft_ids, []
        n = num_accepted(draft, [t.token_id for t in toks]) if draft else 0
        if draft and self.spec is not None:
            self.spec.update(seq.spec, len(draft), n)
            self.num_spec_drafts += 1
            self.num_spec_draft_tokens += len(draft)
            self.num_spec_accepted_tokens += n
        return toks[:n + 1]

    @staticmethod
    def _append(seq: Sequence, tok: SampledToken, now: float) -> EngineOutput:
        """Append one token, then check, in order: finite logits (else ERROR, nothing appended),
        the token-level stop (EOS, a stop token, length: `Sequence.stopping`), then the text-level
        stop a text engine attached (stop strings: `Sequence.stop_text`). A constrained sequence
        advances its matcher first, and ends (EOS) once its format is complete."""
        if not tok.is_finite:
            return EngineOutput(seq, None, FinishReason.ERROR, "the model produced non-finite logits")
        if seq.constraint is not None and not seq.constraint.accept(tok.token_id):
            return EngineOutput(seq, None, FinishReason.ERROR, f"the format refused token {tok.token_id}")
        seq.output_ids.append(tok.token_id)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        reason = seq.stopping(tok.token_id, len(seq.output_ids))
        if reason is None and seq.constraint is not None and seq.constraint.is_terminated:
            reason = FinishReason.EOS  # its stop token, generated under ignore_eos
        if seq.stop_text is not None:
            reason = seq.stop_text(tok.token_id, reason)
        return EngineOutput(seq, tok, reason)
