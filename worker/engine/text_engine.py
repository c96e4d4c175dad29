"""Text in, text out: tokenize → EngineCore → detokenize, stop strings, usage.

The front half of the worker, like vLLM's input/output processors: the engine
core only sees token ids; this class owns the tokenizer, chat templates,
prompt truncation, incremental UTF-8-safe detokenization and stop strings
(matched on text, so they span token boundaries). Each request's `_TextState`
is its sequence's text-level stop (`Sequence.stop_text`): the engine calls it
for every token it accepts, so the text is made, and a stop string ends the
request, inside the engine's one accept step (EngineCore._accept); the text
engine then only collects the step's tokens, text and logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protos.params import (
    ChatMessage,
    FinishReason,
    Logprobs,
    PromptInput,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from worker.engine.core import EngineCore, EngineOutput
from worker.engine.outputs import Admitted, EngineStats, RequestOutput, Resume, context_overflow
from worker.engine.sequence import Sequence
from worker.engine.stopping import StopStringMatcher
from worker.text.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["EngineStats", "TextEngine"]  # EngineStats lives in outputs.py (no torch); kept importable here


@dataclass
class _TextState:
    """One request's text side; called by the engine for each accepted token (a TextStop)."""

    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    truncated_prompt_tokens: int
    deltas: list[str] = field(default_factory=list)  # text of the tokens accepted since `take_text`

    def __call__(self, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        """Detokenize a token (flushing at a token-level stop); STOP once a stop string matched."""
        delta = self.detokenizer.add([token_id])
        if reason is not None:
            delta += self.detokenizer.flush()
        if self.matcher is not None:
            delta, is_stopped = self.matcher.feed(delta)
            if is_stopped:
                reason = FinishReason.STOP
            elif reason is not None:
                delta += self.matcher.flush()
        self.deltas.append(delta)
        return reason

    def take_text(self) -> str:
        text, self.deltas = "".join(self.deltas), []
        return text


class TextEngine:
    def __init__(self, engine: EngineCore, tokenizer: Tokenizer, model_name: str = "model",
                 weights: str = "") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.weights = weights
        self.max_model_len = engine.max_len
        self._states: dict[str, _TextState] = {}
        self._ready: list[RequestOutput] = []  # resumed requests that had already ended

    # -- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                    arrival_time: float | None = None, resume: Resume | None = None,
                    cache_scope: bytes = b"", adapter: str = "") -> Admitted:
        """Queue a request; ValueError (naming the field) if it cannot be served. It shares
        cached prompt blocks only with requests of the same `cache_scope` and `adapter` (a
        loaded LoRA adapter's name, `adapters`; "" = the base model; another name raises a
        ValueError starting with "adapter ").

        With `resume`, the tokens an earlier worker streamed are replayed through the
        detokenizer and stop checks (rebuilding exactly the text state it had) and
        prefilled with the prompt; generation continues with the same seed at the
        next step, so a seeded or greedy answer goes on as if nothing happened.
        """
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already running")
        ids, truncated = self._encode(prompt, params)
        resumed = resume.token_ids if resume is not None else ()
        seq = self.engine.new_sequence(request_id, ids, params, arrival_time,
                                       seed=resume.seed if resume is not None else None, resume_ids=resumed,
                                       cache_scope=cache_scope, adapter=adapter)
        matcher = StopStringMatcher(params.stop) if params.stop else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=True)
        state = _TextState(detok, matcher, truncated)
        reason = None
        for i, token_id in enumerate(resumed):  # the engine's stop checks, as if it had accepted them
            reason = state(token_id, seq.stopping(token_id, i + 1))
            if reason is not None:
                break
        text = state.take_text()
        if resume is not None and resume.first_token_unix:
            seq.first_token_time = seq.last_token_time = resume.first_token_unix
        if reason is not None:  # it had already ended: only the final message is missing
            seq.finish_reason = reason
            self._ready.append(RequestOutput(request_id, finish_reason=reason, usage=self._usage(seq, state)))
        else:
            seq.stop_text = state
            self.engine.submit(seq)
            self._states[request_id] = state
        return Admitted(seq.seed, text, len(ids))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # -- LoRA adapters (between steps, on the thread that calls step()) -----
    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name: loaded and not unloading (none with LoRA off)."""
        return self.engine.adapters.names if self.engine.adapters is not None else ()

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT LoRA folder as adapter `name`; ValueError on bad files, a taken or invalid
        name, or with LoRA off."""
        if self.engine.adapters is None:
            raise ValueError(f"adapter {name!r}: LoRA is off on this worker (enable_lora)")
        self.engine.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Refuse new requests of `name` now; its requests in flight finish with it, then its
        weights are freed. ValueError if it is not loaded."""
        self.engine.unload_adapter(name)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self._ready)

    def stats(self) -> EngineStats:
        sched, kv = self.engine.scheduler, self.engine.kv
        return EngineStats(
            model_name=self.model_name, weights=self.weights, num_running=sched.num_running,
            num_waiting=sched.num_waiting + len(self.engine.compiling),
            max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len, block_size=kv.block_size,
            num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks, kv_cache_usage=kv.usage,
            num_prefix_cache_hit_tokens=kv.num_prefix_hit_tokens,
            num_prefix_cache_query_tokens=kv.num_prefix_query_tokens, num_preemptions=sched.num_preemptions,
            num_step_prefill_tokens=self.engine.num_step_prefill_tokens,
            num_step_decode_tokens=self.engine.num_step_decode_tokens,
            num_spec_drafts=self.engine.num_spec_drafts,
            num_spec_draft_tokens=self.engine.num_spec_draft_tokens,
            num_spec_accepted_tokens=self.engine.num_spec_accepted_tokens,
            num_running_by_adapter=self._running_by_adapter(), **self._grammar_stats())

    def _running_by_adapter(self) -> dict[str, int]:
        if self.engine.adapters is None:
            return {}
        counts = dict.fromkeys(self.engine.adapters.loaded, 0)
        for seq in self.engine.scheduler.running.values():
            if seq.adapter:
                counts[seq.adapter] = counts.get(seq.adapter, 0) + 1
        return counts

    def _grammar_stats(self) -> dict[str, Any]:
        grammar = self.engine.grammar
        if grammar is None:
            return {}
        return dict(num_grammar_compiles=grammar.num_compiles,
                    grammar_compile_seconds=tuple(grammar.recent_compile_seconds),
                    num_grammar_cache_hits=grammar.num_hits, num_grammar_cache_misses=grammar.num_misses,
                    grammar_mask_seconds=self.engine.runner.mask_seconds)

    def step(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        runs: dict[str, list[EngineOutput]] = {}  # a verified run gives several tokens, in order
        for o in self.engine.step():
            if o.seq.request_id in self._states:
                runs.setdefault(o.seq.request_id, []).append(o)
        return ready + [self._to_output(run) for run in runs.values()]

    # -- prompt -------------------------------------------------------------
    def _encode(self, prompt: PromptInput, params: SamplingParams) -> tuple[list[int], int]:
        room = self.max_model_len - params.max_tokens
        if room < 1:
            raise ValueError(f"max_tokens ({params.max_tokens}) must be below the context "
                             f"length ({self.max_model_len})")
        if prompt.messages is not None:
            return self._encode_chat(list(prompt.messages), room, params.truncate_prompt)
        assert prompt.prompt is not None
        ids = self.tokenizer.encode(prompt.prompt)
        if len(ids) <= room:
            return ids, 0
        if not params.truncate_prompt:
            raise context_overflow(len(ids), params.max_tokens, self.max_model_len)
        return ids[len(ids) - room:], len(ids) - room

    def _encode_chat(self, messages: list[ChatMessage], room: int, truncate: bool) -> tuple[list[int], int]:
        ids = self._render(messages)
        full = len(ids)
        # drop the oldest non-system messages until it fits; the last message always stays
        while len(ids) > room and truncate:
            drop = next((i for i, m in enumerate(messages[:-1]) if m.role != "system"), None)
            if drop is None:
                break
            del messages[drop]
            ids = self._render(messages)
        if len(ids) > room:
            raise context_overflow(len(ids), self.max_model_len - room, self.max_model_len)
        return ids, full - len(ids)

    def _render(self, messages: list[ChatMessage]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- outputs ------------------------------------------------------------
    def _to_output(self, run: list[EngineOutput]) -> RequestOutput:
        """One request's tokens from one step, and the text the engine's stop checks made of them
        (`_TextState`); the engine's outputs for a request end at its stop, if any."""
        seq = run[0].seq
        state = self._states[seq.request_id]
        out = RequestOutput(seq.request_id)
        for o in run:
            if o.token is not None:
                out.token_ids.append(o.token.token_id)
                if seq.params.num_logprobs is not None:
                    out.logprobs = (out.logprobs or []) + self._logprobs(o)
        out.text = state.take_text()
        reason = run[-1].finish_reason
        if reason is not None:
            out.finish_reason = reason
            out.error = seq.error
            out.is_invalid_request = seq.is_invalid_request
            out.usage = self._usage(seq, state)
            del self._states[seq.request_id]
        return out

    def _logprobs(self, o: EngineOutput) -> list[Logprobs]:
        tok = o.token
        assert tok is not None
        n = o.seq.params.top_logprobs
        text = self.tokenizer.token_text
        chosen = TokenLogprob(tok.token_id, float(tok.logprob or 0.0), text(tok.token_id))
        top = [TokenLogprob(i, float(lp), text(i)) for i, lp in (tok.top or [])[:n]]
        return [Logprobs(chosen, top)]

    @staticmethod
    def _usage(seq: Sequence, state: _TextState) -> Usage:
        now = time.time()
        admitted = seq.admitted_time or now
        first = seq.first_token_time
        return Usage(
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
            queue_time_s=max(0.0, admitted - seq.arrival_time),
            time_to_first_token_s=max(0.0, first - seq.arrival_time) if first else 0.0,
            decode_time_s=(seq.last_token_time or now) - first if first else 0.0,
            seed=seq.seed, truncated_prompt_tokens=state.truncated_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens, num_draft_tokens=seq.spec.num_draft_tokens,
            num_accepted_tokens=seq.spec.num_accepted_tokens,
            is_constrained=seq.params.response_format is not None,
        )

