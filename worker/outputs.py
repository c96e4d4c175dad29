"""What the text engine hands back after each step (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.params import FinishReason, Logprobs, Usage


@dataclass
class RequestOutput:
    """New tokens of one request from one step; the last one has `finished`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)  # generated this step
    text: str = ""  # text delta, UTF-8 safe, stop strings held back
    logprobs: list[Logprobs] | None = None  # one per token id when requested
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # set on the final output
    error: str | None = None  # set with FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
