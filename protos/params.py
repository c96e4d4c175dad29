"""Request parameters shared by the gateway and the worker (no torch, no grpc).

These are the plain-Python forms of the contract in `tokenrelay/v1/*.proto`.
Both sides build them with `protos.convert.params_from_pb`, so a bad field is
rejected with the same message at the gateway (INVALID_ARGUMENT) and, should a
request bypass the gateway, again at the worker.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_STREAM_INTERVAL = 256  # tokens per chunk: GenerateRequest.stream_interval
MAX_SEED = 2**64 - 1  # the whole uint64 range of the proto field
CHAT_ROLES = ("system", "user", "assistant", "tool")
# ResponseFormat (generate.proto): the kinds, and the caps that keep one format's compilation
# on a worker bounded (what each costs is measured next to it).
RESPONSE_FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_RESPONSE_FORMAT_BYTES = 64 * 1024  # schema, regex, grammar, or all choices together
MAX_CHOICES = 256
# JSON levels (objects and arrays) of a JSON Schema, ~64 nested object properties: the gateway's
# meta-schema check and the worker's compiler (~50 ms at this depth) both stay well inside bounds.
MAX_SCHEMA_DEPTH = 128
# Object properties in a JSON Schema, all objects together. xgrammar's compile time grows
# linearly with them, ~8 ms each over SmolLM2's vocabulary (2026-12-02, 2-core Xeon: 64 in
# 0.55 s, 256 in 2.0 s, 512 in 4.0 s, 1,000 in ~8 s, required or not), so 256 bounds a new
# schema's wait (off the step loop) at ~2 s there; a larger one is refused with the limit.
MAX_SCHEMA_PROPERTIES = 256


class FinishReason(enum.Enum):
    """Why a request ended. Values mirror `tokenrelay.v1.FinishReason`."""

    STOP = 1  # stop string or stop token id
    LENGTH = 2  # max_tokens or context length reached
    EOS = 3  # the model's end-of-sequence token
    ABORT = 4  # cancelled by the caller (or its deadline passed)
    ERROR = 5  # the request failed (e.g. non-finite logits)


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok or math.isnan(value):
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}")


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the generated text (GenerateRequest.response_format). Validated on construction;
    `protos.response_format.check_response_format` adds the checks that parse the text."""

    kind: str  # one of RESPONSE_FORMAT_KINDS
    text: str = ""  # the JSON Schema, the regex or the grammar; "" for json_object and choice
    choices: tuple[str, ...] = ()  # choice only
    is_strict: bool = False  # json_schema: JsonSchema.strict

    def __post_init__(self) -> None:
        if self.kind not in RESPONSE_FORMAT_KINDS:
            raise ValueError(f"response_format must be one of {', '.join(RESPONSE_FORMAT_KINDS)}, "
                             f"got {self.kind!r}")
        path = self.field_path
        if self.kind in ("json_schema", "regex", "grammar") and not self.text:
            raise ValueError(f"{path} must not be empty")
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise ValueError(f"{path} needs 1..{MAX_CHOICES} strings, got {len(self.choices)}")
            if not all(self.choices):
                raise ValueError(f"{path} must not hold an empty string")
        num_bytes = len(self.text.encode()) + sum(len(c.encode()) for c in self.choices)
        if num_bytes > MAX_RESPONSE_FORMAT_BYTES:
            raise ValueError(f"{path} is {num_bytes} bytes; the limit is {MAX_RESPONSE_FORMAT_BYTES}")

    @property
    def field_path(self) -> str:
        """The proto field that holds the format's text, for error messages."""
        inner = {"json_schema": "json_schema.schema", "choice": "choice.choices"}.get(self.kind, self.kind)
        return f"response_format.{inner}"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples, when it stops, and how urgent it is. Validated on construction."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None = the worker draws one and reports it
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and of the N most likely alternatives
    truncate_prompt: bool = False  # left-truncate the prompt to fit the context
    # GenerateRequest.priority: larger = served earlier. Its class picks the request stream
    # (protos/keys.py); the engine preempts the lowest priority first.
    priority: int = 0
    response_format: ResponseFormat | None = None  # structured output; None = free text
    # GenerateRequest.stream_interval: tokens per chunk after the first (0 on the wire = 1)
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 0 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"stream_interval must be in [0, {MAX_STREAM_INTERVAL}], "
                             f"got {self.stream_interval}")
        object.__setattr__(self, "stream_interval", max(1, self.stream_interval))  # frozen: normalised once

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_logprobs(self) -> int | None:
        """None = no logprobs; otherwise how many alternatives per token."""
        return self.top_logprobs if (self.logprobs or self.top_logprobs) else None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"messages.role must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of `prompt` (raw text) or `messages` (chat)."""

    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages must be set")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")


@dataclass
class Usage:
    """Accounting for one finished request (times in seconds)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_time_s: float = 0.0
    seed: int = 0
    truncated_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for verification
    num_accepted_tokens: int = 0  # of those, accepted (they equal the target's own tokens)
    is_constrained: bool = False  # the request had a response_format


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass
class Logprobs:
    chosen: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)
