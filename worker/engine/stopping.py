"""When a request stops: token-level criteria and incremental stop-string matching (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protos.params import FinishReason, SamplingParams


class StoppingCriteria:
    """Token-level stop checks for one request, called once per generated token.

    The token that triggers a stop is still returned to the caller (it was generated and is
    counted in usage); whether its *text* is shown is the detokenizer's business. For EOS and
    stop tokens the engine usually skips special tokens when decoding, so nothing visible leaks.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_new_tokens = max_new_tokens  # min(params.max_tokens, room left in the context)

    def __call__(self, token_id: int, num_generated: int) -> FinishReason | None:
        """`num_generated` counts the generated tokens including `token_id`.

        Precedence: EOS (unless ignore_eos) → stop token id → length.
        """
        if token_id in self.eos_token_ids:
            return FinishReason.EOS
        if token_id in self.stop_token_ids:
            return FinishReason.STOP
        if num_generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None


class TextStop(Protocol):
    """A text-level stop check (stop strings) that the text engine attaches to a sequence; the
    engine calls it after StoppingCriteria for each token it accepts (EngineCore._accept)."""

    def __call__(self, token_id: int, reason: FinishReason | None) -> FinishReason | None:
        """`reason`: the token-level stop of `token_id` (None: none); returns the stop that holds
        once its text is known (a matched stop string: STOP)."""
        ...


class StopStringMatcher:
    """Finds stop strings in streamed text that arrives in arbitrary pieces.

    `feed` returns text that is safe to emit now: it can never turn out to be part of a stop
    string. A tail of the text that is a proper prefix of some stop string is held back until a
    later piece settles it (at most `max(len(stop)) - 1` characters). When several stops match,
    the one that is complete first in the stream wins (earliest end; on a tie the longest),
    so the result never depends on how the text was split. Output ends right before the stop;
    the stop string and everything after it are dropped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(dict.fromkeys(stops))  # de-duplicated, order kept
        self.max_held_chars = max((len(stop) for stop in self.stops), default=1) - 1
        self._first_chars = frozenset(stop[0] for stop in self.stops)
        self._held = ""
        self.is_stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add the next piece of text; return (text safe to emit now, whether a stop matched)."""
        if self.is_stopped:
            return "", True
        text = self._held + delta
        stop_start = self._find_first_stop(text)
        if stop_start is not None:
            self._held, self.is_stopped = "", True
            return text[:stop_start], True
        cut = self._held_start(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """End of generation without a stop match: release the held-back text."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _find_first_stop(self, text: str) -> int | None:
        """Start of the stop occurrence that ends first in `text` (ties: the longest), or None.

        Earlier feeds held no complete stop, so any match here ends inside the new delta.
        """
        best: tuple[int, int] | None = None  # (end, start): the smallest end, then the smallest start
        for stop in self.stops:
            start = text.find(stop)  # the first occurrence of a stop is also its earliest end
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _held_start(self, text: str) -> int:
        """Index where the longest suffix of `text` that is a proper prefix of a stop begins."""
        for start in range(max(0, len(text) - self.max_held_chars), len(text)):
            if text[start] not in self._first_chars:
                continue
            tail = text[start:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self.stops):
                return start
        return len(text)
