"""A simulated engine: the TextEngine contract with no model, no tokenizer and no torch.

`tokenrelay-worker --engine sim` runs the whole worker (claim, reconciliation, park,
publish, heartbeats, metrics) around this class, so routing, failover and
scaling are tested and capacity is planned without GPUs (llm-d ships a vLLM
simulator for the same reason). It keeps the real engine's contract:

- continuous batching: up to max_num_seqs run, the rest wait (`num_waiting`);
  a request's first step prefills its prompt and emits its first token, each
  later step emits one token per running request;
- a step sleeps `step_ms + ms_per_token * (decode rows + prompt tokens
  prefilled)` (the GPU time it stands for); nothing to run: no sleep;
- token i of a request is `sim_token_ids(seed, i, 1, salt)` (its adapter, if any, in the
  salt), so a resumed
  request (`Resume`) goes on with exactly the tokens it would have had, and a
  test can check every token of every stream;
- the same validation messages, finish reasons (LENGTH, STOP on a stop token or
  stop string, ABORT one step after `abort`) and Usage as TextEngine.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field

from protos.params import FinishReason, Logprobs, PromptInput, SamplingParams, TokenLogprob, Usage
from worker.engine.config import EngineConfig, SimConfig
from worker.engine.outputs import Admitted, EngineStats, RequestOutput, Resume, context_overflow
from worker.engine.stopping import StopStringMatcher

SIM_VOCAB_SIZE = 32000
DEFAULT_SIM_MAX_MODEL_LEN = 2048  # as the model engine's default (worker/factory.py)
BLOCK_SIZE = 16
CHARS_PER_TOKEN = 4  # a typical BPE tokenizer on English text


def sim_token_ids(seed: int, start: int, count: int, salt: str = "") -> list[int]:
    """Tokens start..start+count-1 of a request with this seed: a hash of (seed, index, salt),
    in [1, SIM_VOCAB_SIZE) (0 is left out: it is often a pad or unknown token)."""
    prefix, tail = seed.to_bytes(8, "little"), salt.encode()
    ids = []
    for i in range(start, start + count):
        digest = hashlib.blake2b(prefix + i.to_bytes(8, "little") + tail, digest_size=8).digest()
        ids.append(1 + int.from_bytes(digest, "little") % (SIM_VOCAB_SIZE - 1))
    return ids


def sim_text(token_id: int) -> str:
    return f" t{token_id}"


def sim_prompt_tokens(prompt: PromptInput) -> int:
    """The prompt's length in tokens, estimated from its characters (at least one, like a template)."""
    messages = prompt.messages or ()
    chars = len(prompt.prompt) if prompt.prompt is not None else sum(len(m.content) for m in messages)
    return max(1, -(-chars // CHARS_PER_TOKEN))


@dataclass
class _SimRequest:
    request_id: str
    params: SamplingParams
    seed: int
    num_prompt_tokens: int
    num_truncated_tokens: int
    arrival_time: float
    matcher: StopStringMatcher | None
    salt: str  # the engine's salt, and the request's adapter: an adapter's tokens are its own
    output_ids: list[int] = field(default_factory=list)  # resumed ones first
    admitted_time: float | None = None
    first_token_time: float = 0.0
    last_token_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)


class SimEngine:
    def __init__(self, config: SimConfig | None = None, *, max_num_seqs: int = 128,
                 max_model_len: int = DEFAULT_SIM_MAX_MODEL_LEN, adapters: tuple[str, ...] = ()) -> None:
        """`adapters`: the names of the LoRA adapters it pretends to have loaded (more with
        `load_adapter`); a request's adapter is mixed into its tokens' salt."""
        if max_num_seqs < 1 or max_model_len < 2:
            raise ValueError(f"max_num_seqs must be >= 1 and max_model_len >= 2, got {max_num_seqs} and "
                             f"{max_model_len}")
        self.config = config or SimConfig()
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.num_blocks = max_num_seqs * -(-max_model_len // BLOCK_SIZE)  # full-length sequences all fit
        self._waiting: dict[str, _SimRequest] = {}  # in arrival order
        self._running: dict[str, _SimRequest] = {}
        self._ready: list[RequestOutput] = []  # resumed requests that had already ended
        self._aborts: set[str] = set()
        self._lock = threading.Lock()  # abort() may come from another thread, like EngineCore's
        self._num_step_prefill_tokens = self._num_step_decode_tokens = 0
        self._adapters = set(adapters)

    @classmethod
    def from_config(cls, sim: SimConfig, engine: EngineConfig) -> SimEngine:
        return cls(sim, max_num_seqs=engine.max_num_seqs,
                   max_model_len=engine.max_model_len or DEFAULT_SIM_MAX_MODEL_LEN,
                   adapters=tuple(name for name, _ in engine.adapters))

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted(self._adapters))

    def load_adapter(self, name: str, path: str) -> None:
        """Nothing is read: the name is served from now on."""
        self._adapters.add(name)

    def unload_adapter(self, name: str) -> None:
        """New requests for it are refused; those running finish with their salt."""
        self._adapters.discard(name)

    # -- requests -----------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                    arrival_time: float | None = None, resume: Resume | None = None,
                    cache_scope: bytes = b"", adapter: str = "") -> Admitted:
        """Queue a request; ValueError (naming the limit) if the real engine would refuse it.
        `cache_scope` is accepted and unused: the simulator caches no prefixes."""
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request_id {request_id!r} is already running")
        if adapter and adapter not in self._adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded (loaded: "
                             f"{', '.join(self.adapters) or 'none'})")
        num_prompt, num_truncated = self._fit_prompt(sim_prompt_tokens(prompt), params)
        seed = resume.seed if resume is not None else params.seed
        if seed is None:
            seed = random.getrandbits(63)
        req = _SimRequest(request_id, params, seed, num_prompt, num_truncated,
                          arrival_time if arrival_time is not None else time.time(),
                          StopStringMatcher(params.stop) if params.stop else None,
                          f"{self.config.salt}|{adapter}" if adapter else self.config.salt)
        texts, reason = [], None
        for token_id in resume.token_ids if resume is not None else ():  # rebuild the stop-string state
            req.output_ids.append(token_id)
            delta, reason = self._accept(req, token_id)
            texts.append(delta)
            if reason is not None:
                break
        if resume is not None and resume.first_token_unix:
            req.first_token_time = req.last_token_time = resume.first_token_unix
        if reason is not None:  # it had already ended: only the final message is missing
            self._ready.append(self._final(req, reason))
        else:
            self._waiting[request_id] = req
        return Admitted(req.seed, "".join(texts), num_prompt)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the next step returns the request's ABORT output (waiting or running)."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._ready or self._aborts)

    def step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready + self._apply_aborts(), []
        started = self._start_waiting()
        self._num_step_prefill_tokens = sum(r.num_tokens for r in started)  # prompt + resumed tokens
        self._num_step_decode_tokens = len(self._running) - len(started)
        if not self._running:
            return outputs
        self._sleep(self._num_step_prefill_tokens + self._num_step_decode_tokens)
        return outputs + [self._decode(req) for req in list(self._running.values())]

    def stats(self) -> EngineStats:
        c = self.config
        used = sum(-(-r.num_tokens // BLOCK_SIZE) for r in self._running.values())
        return EngineStats(
            model_name="sim", weights=f"sim step {c.step_ms:g} ms + {c.ms_per_token:g} ms/token",
            num_running=len(self._running), num_waiting=len(self._waiting), max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, block_size=BLOCK_SIZE, num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - used, kv_cache_usage=used / self.num_blocks,
            num_prefix_cache_hit_tokens=0, num_prefix_cache_query_tokens=0, num_preemptions=0,
            num_step_prefill_tokens=self._num_step_prefill_tokens,
            num_step_decode_tokens=self._num_step_decode_tokens)

    # -- internals ----------------------------------------------------------
    def _fit_prompt(self, num_tokens: int, params: SamplingParams) -> tuple[int, int]:
        """(prompt tokens kept, tokens truncated): TextEngine's checks and messages."""
        room = self.max_model_len - params.max_tokens
        if room < 1:
            raise ValueError(f"max_tokens ({params.max_tokens}) must be below the context "
                             f"length ({self.max_model_len})")
        if num_tokens <= room:
            return num_tokens, 0
        if not params.truncate_prompt:
            raise context_overflow(num_tokens, params.max_tokens, self.max_model_len)
        return room, num_tokens - room

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        outputs = []
        for request_id in aborts:  # unknown ids (finished already) are ignored, as in EngineCore
            req = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
            if req is not None:
                outputs.append(self._final(req, FinishReason.ABORT))
        return outputs

    def _start_waiting(self) -> list[_SimRequest]:
        started = []
        now = time.time()
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.pop(next(iter(self._waiting)))
            req.admitted_time = req.admitted_time or now
            self._running[req.request_id] = req
            started.append(req)
        return started

    def _sleep(self, num_tokens: int) -> None:
        ms = self.config.step_ms + self.config.ms_per_token * num_tokens
        if ms > 0:
            time.sleep(ms / 1000)  # stands for the GPU time of the step

    def _decode(self, req: _SimRequest) -> RequestOutput:
        token_id = sim_token_ids(req.seed, len(req.output_ids), 1, req.salt)[0]
        req.output_ids.append(token_id)
        req.last_token_time = time.time()
        req.first_token_time = req.first_token_time or req.last_token_time
        text, reason = self._accept(req, token_id)
        out = RequestOutput(req.request_id, [token_id], text, self._logprobs(req.params, token_id))
        if reason is not None:
            del self._running[req.request_id]
            out.finish_reason, out.usage = reason, self._usage(req)
        return out

    @staticmethod
    def _accept(req: _SimRequest, token_id: int) -> tuple[str, FinishReason | None]:
        """The text delta of a token just appended, and the finish reason it causes (stop token
        id, then length, then a stop string matched on the text, as StoppingCriteria + TextEngine)."""
        reason = None
        if token_id in req.params.stop_token_ids:
            reason = FinishReason.STOP
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        delta = sim_text(token_id)
        if req.matcher is not None:
            delta, is_stopped = req.matcher.feed(delta)
            if is_stopped:
                reason = FinishReason.STOP
            elif reason is not None:
                delta += req.matcher.flush()
        return delta, reason

    @staticmethod
    def _logprobs(params: SamplingParams, token_id: int) -> list[Logprobs] | None:
        """Certain tokens (logprob 0); the alternatives are the next ids, each less likely."""
        if params.num_logprobs is None:
            return None
        chosen = TokenLogprob(token_id, 0.0, sim_text(token_id))
        alternatives = [1 + (token_id + k - 1) % (SIM_VOCAB_SIZE - 1) for k in range(1, params.num_logprobs)]
        top = [chosen] + [TokenLogprob(t, -float(k), sim_text(t)) for k, t in enumerate(alternatives, 1)]
        return [Logprobs(chosen, top[:params.num_logprobs])]

    def _final(self, req: _SimRequest, reason: FinishReason) -> RequestOutput:
        return RequestOutput(req.request_id, finish_reason=reason, usage=self._usage(req))

    @staticmethod
    def _usage(req: _SimRequest) -> Usage:
        now = time.time()
        admitted, first = req.admitted_time or now, req.first_token_time
        return Usage(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(req.output_ids),
            queue_time_s=max(0.0, admitted - req.arrival_time),
            time_to_first_token_s=max(0.0, first - req.arrival_time) if first else 0.0,
            decode_time_s=(req.last_token_time or now) - first if first else 0.0,
            seed=req.seed, truncated_prompt_tokens=req.num_truncated_tokens)
