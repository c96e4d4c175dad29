"""Text in, text out: tokenize → Engine → detokenize, stop strings, usage.

The front half of the worker, like vLLM's input/output processors: the engine
core only sees token ids; this class owns the tokenizer, chat templates,
prompt truncation, incremental UTF-8-safe detokenization and stop strings
(matched on text, so they span token boundaries; a match ends the request in
the engine before the next step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from protos.params import (
    ChatMessage,
    FinishReason,
    Logprobs,
    PromptInput,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from worker.engine import Engine, EngineOutput, context_overflow
from worker.engine_config import EngineConfig
from worker.outputs import RequestOutput
from worker.sequence import Sequence
from worker.stopping import StopStringMatcher
from worker.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class EngineStats:
    model_name: str
    num_running: int
    num_waiting: int
    max_num_seqs: int
    num_free_slots: int
    max_model_len: int


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    truncated_prompt_tokens: int


class TextEngine:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, model_name: str = "model") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_len
        self._states: dict[str, _TextState] = {}

    @classmethod
    def from_config(cls, config: EngineConfig) -> TextEngine:
        from worker.factory import build_text_engine  # torch + weights live there

        return build_text_engine(config)

    # -- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        """Queue a request; ValueError (naming the field) if it cannot be served."""
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already running")
        ids, truncated = self._encode(prompt, params)
        self.engine.add_request(request_id, ids, params, arrival_time)
        matcher = StopStringMatcher(params.stop) if params.stop else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=True)
        self._states[request_id] = _TextState(detok, matcher, truncated)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        sched = self.engine.scheduler
        return EngineStats(self.model_name, sched.num_running, sched.num_waiting, self.engine.kv.num_slots,
                           self.engine.kv.num_free_slots, self.max_model_len)

    def step(self) -> list[RequestOutput]:
        return [self._to_output(o) for o in self.engine.step() if o.seq.request_id in self._states]

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
    def _to_output(self, o: EngineOutput) -> RequestOutput:
        seq = o.seq
        state = self._states[seq.request_id]
        out = RequestOutput(seq.request_id)
        reason = o.finish_reason
        if o.token is not None:
            out.token_ids = [o.token.token_id]
            out.logprobs = self._logprobs(o) if seq.params.num_logprobs is not None else None
            delta = state.detokenizer.add(out.token_ids)
            if reason is not None:
                delta += state.detokenizer.flush()
            if state.matcher is not None:
                delta, is_stopped = state.matcher.feed(delta)
                if is_stopped:
                    if reason is None:
                        self.engine.finish(seq.request_id, FinishReason.STOP)
                    reason = FinishReason.STOP
                elif reason is not None:
                    delta += state.matcher.flush()
            out.text = delta
        if reason is not None:
            out.finish_reason = reason
            out.error = seq.error
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
        )

