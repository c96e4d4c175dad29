"""The engine's mutable per-request state (no torch, no wire formats)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from protos.params import FinishReason, SamplingParams
from worker.engine.stopping import StoppingCriteria, TextStop


class SequenceStatus(enum.Enum):
    WAITING = 1  # queued in the engine (new, or preempted), holds no KV blocks
    RUNNING = 2  # holds KV blocks; prefilled or about to be
    FINISHED = 3


class SpecState:
    """One sequence's speculation: this step's proposals, what the policy learnt, its counts."""

    __slots__ = ("draft_ids", "accepted", "rejected", "num_skipped", "backoff", "num_drafts",
                 "num_draft_tokens", "num_accepted_tokens")

    def __init__(self) -> None:
        self.draft_ids: list[int] = []  # proposed for this step; [] = a plain decode
        # Moving sums of accepted proposals and of rejections (a run ends at the first), whose
        # ratio estimates the chance that a proposal is accepted (spec_policy.py). The start
        # is optimistic: 0.8 with the weight of two verify steps.
        self.accepted, self.rejected = 1.6, 0.4
        self.num_skipped = 0  # steps without proposals since the last probe
        self.backoff = 1  # steps between probes while speculation does not pay
        self.num_drafts = 0  # verify steps
        self.num_draft_tokens = 0  # proposed, over the request
        self.num_accepted_tokens = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: params.seed or one drawn by the engine
    stopping: StoppingCriteria
    stop_text: TextStop | None = None  # stop strings, checked on the text after `stopping`
    # Shares cached prompt blocks only with sequences of the same scope (b"": the unscoped default).
    cache_scope: bytes = b""
    adapter: str = ""  # the LoRA adapter it runs with (worker/engine/adapters.py); "" = the base model
    arrival_time: float = field(default_factory=time.time)  # unix seconds
    output_ids: list[int] = field(default_factory=list)
    # Output tokens that prefill computes with the prompt instead of decoding them; they count
    # as output all the same (penalties, max_tokens, usage). Two kinds, in this order in output_ids:
    num_carried_over_tokens: int = 0  # generated and streamed by an earlier worker (a resumed request)
    num_recomputed_tokens: int = 0  # generated here before the last preemption (Scheduler._preempt)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # leading prompt tokens found in the prefix cache at first admission
    finish_reason: FinishReason | None = None
    error: str | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    spec: SpecState = field(default_factory=SpecState)  # proposals and their counts
    # grammar.Constraint of a request with a response_format, else None (Any: importing it here
    # would bring torch to the scheduler, which imports this module)
    constraint: Any = None
    is_invalid_request: bool = False  # failed because of its input (a format that does not compile)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.prompt_ids) + self.num_carried_over_tokens + self.num_recomputed_tokens

    @property
    def prefill_ids(self) -> list[int]:
        """What prefill computes: the prompt, then the carried-over and the recomputed output."""
        return self.prompt_ids + self.output_ids[:self.num_carried_over_tokens + self.num_recomputed_tokens]

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def sampled_sequences(prefills: list[PrefillChunk], decodes: list[Sequence]) -> list[Sequence]:
    """Who gets a token this step, in the runner's output order: prompts completed by
    their chunk, then every decode."""
    return [c.seq for c in prefills if c.is_last] + decodes


@dataclass
class PrefillChunk:
    """Prompt tokens [start, start + num_tokens) of one sequence, computed this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def is_last(self) -> bool:
        """The prompt is complete after this chunk: its first token is sampled this step."""
        return self.start + self.num_tokens >= self.seq.num_prefill_tokens
