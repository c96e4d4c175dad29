"""What goes in and out of the text engine besides text (plain Python, no torch)."""

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


@dataclass(frozen=True)
class Resume:
    """Where an earlier worker left a request (from `queue.Progress`)."""

    token_ids: tuple[int, ...]  # generated and already streamed
    seed: int
    first_token_unix: float = 0.0


@dataclass(frozen=True)
class Admitted:
    seed: int  # the sampling seed in use (drawn when the request gave none)
    text: str = ""  # text already streamed for the resumed tokens ("" for a new request)
