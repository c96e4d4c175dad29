"""The engine's mutable per-request state (no torch, no wire formats)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protos.params import FinishReason, SamplingParams
from worker.stopping import StoppingCriteria


class SequenceStatus(enum.Enum):
    WAITING = 1  # queued in the engine, no KV cache slot yet
    RUNNING = 2  # holds a slot; prefilled or about to be
    FINISHED = 3


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: params.seed or one drawn by the engine
    stopping: StoppingCriteria
    arrival_time: float = field(default_factory=time.time)  # unix seconds
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
