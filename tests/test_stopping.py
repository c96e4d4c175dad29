"""Tests for worker/engine/stopping.py: token-level criteria and incremental stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.params import FinishReason, SamplingParams
from worker.engine.stopping import StoppingCriteria, StopStringMatcher

EOS = frozenset({2, 99})


@pytest.mark.parametrize(
    ("params", "max_new_tokens", "token_id", "num_generated", "expected"),
    [
        (SamplingParams(), 10, 5, 1, None),
        (SamplingParams(), 10, 2, 1, FinishReason.EOS),
        (SamplingParams(), 10, 99, 4, FinishReason.EOS),  # any of several EOS ids
        (SamplingParams(ignore_eos=True), 10, 2, 1, None),
        (SamplingParams(stop_token_ids=(7, 8)), 10, 8, 3, FinishReason.STOP),
        (SamplingParams(stop_token_ids=(2,)), 10, 2, 3, FinishReason.EOS),  # EOS takes precedence
        (SamplingParams(stop_token_ids=(2,), ignore_eos=True), 10, 2, 3, FinishReason.STOP),
        (SamplingParams(), 10, 5, 9, None),
        (SamplingParams(), 10, 5, 10, FinishReason.LENGTH),  # num_generated includes this token
        (SamplingParams(max_tokens=1), 1, 5, 1, FinishReason.LENGTH),
        (SamplingParams(), 10, 2, 10, FinishReason.EOS),  # EOS on the last allowed token is still EOS
        (SamplingParams(stop_token_ids=(7,)), 3, 7, 3, FinishReason.STOP),
    ],
)
def test_stopping_criteria(
    params: SamplingParams,
    max_new_tokens: int,
    token_id: int,
    num_generated: int,
    expected: FinishReason | None,
) -> None:
    assert StoppingCriteria(params, EOS, max_new_tokens)(token_id, num_generated) is expected


def test_stopping_criteria_rejects_no_room() -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        StoppingCriteria(SamplingParams(), EOS, 0)


def run_matcher(stops: Sequence[str], deltas: Sequence[str]) -> tuple[list[str], bool, str]:
    """Feed deltas until a stop; return (emitted piece per fed delta, stopped, flush())."""
    matcher = StopStringMatcher(stops)
    pieces, stopped = [], False
    for delta in deltas:
        piece, stopped = matcher.feed(delta)
        pieces.append(piece)
        if stopped:
            break
    return pieces, stopped, matcher.flush()


@pytest.mark.parametrize(
    ("stops", "deltas", "pieces", "stopped", "flushed"),
    [
        # no stops: pass-through
        ([], ["Hello", " world"], ["Hello", " world"], False, ""),
        # stop inside one delta: text before it is emitted, the stop and after are dropped
        (["###"], ["ab###cd"], ["ab"], True, ""),
        # stop spanning two deltas: the partial prefix is held, then dropped
        (["###"], ["ab#", "##cd"], ["ab", ""], True, ""),
        # stop spanning three deltas
        (["STOP"], ["xS", "T", "OPy"], ["x", "", ""], True, ""),
        # partial prefix held, then released when it turns out not to be a stop
        (["###"], ["ab##", "x"], ["ab", "##x"], False, ""),
        (["abc"], ["a", "b", "d"], ["", "", "abd"], False, ""),
        # held prefix released by flush at the end
        (["###"], ["ab#"], ["ab"], False, "#"),
        (["</s>"], ["done</"], ["done"], False, "</"),
        # stop at the very first character
        (["x"], ["xyz"], [""], True, ""),
        (["\n\n"], ["\n", "\nmore"], ["", ""], True, ""),
        # several stops: the one that completes first wins
        (["world", "lo"], ["hello world"], ["hel"], True, ""),
        (["abc", "b"], ["abc"], ["a"], True, ""),  # "b" ends first although "abc" starts first
        (["abc", "b"], ["a", "bc"], ["", "a"], True, ""),  # same answer however it is split
        (["ab", "xaby"], ["xab"], ["x"], True, ""),
        (["ab", "abc"], ["zab"], ["z"], True, ""),  # same end: the longest; here only "ab" is complete
        (["bc", "abc"], ["zabc"], ["z"], True, ""),  # same end: the longest wins
        # overlapping prefix: "aab" must not be missed after a held "a"
        (["ab"], ["a", "a", "b"], ["", "a", ""], True, ""),
        # after a stop, further feeds emit nothing
        (["."], ["a.", "b"], ["a"], True, ""),
        # unicode
        (["。"], ["こんにちは。さ"], ["こんにちは"], True, ""),
    ],
)
def test_stop_string_matcher(
    stops: list[str], deltas: list[str], pieces: list[str], stopped: bool, flushed: str
) -> None:
    assert run_matcher(stops, deltas) == (pieces, stopped, flushed)


def test_feed_after_stop_emits_nothing() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("a.b") == ("a", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_held_text_is_bounded_by_the_longest_stop() -> None:
    matcher = StopStringMatcher(["aaab", "c"])
    emitted = "".join(matcher.feed("a")[0] for _ in range(100))
    assert len(emitted) == 100 - 3  # never more than len("aaab") - 1 held back
    assert matcher.flush() == "aaa"


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def first_stop_start(text: str, stops: Sequence[str]) -> int | None:
    """Reference: where the output must end — the start of the stop that completes first."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return end - len(stop)
    return None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab#\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_streamed_output_is_the_text_up_to_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stop_at = first_stop_start(text, stops)
    limit = len(text) if stop_at is None else stop_at

    matcher = StopStringMatcher(stops)
    emitted, stopped = "", False
    for delta in deltas:
        piece, stopped = matcher.feed(delta)
        emitted += piece
        assert len(emitted) <= limit  # nothing past the stop is ever emitted, even transiently
        assert text.startswith(emitted)
        if stopped:
            break
    emitted += matcher.flush()
    assert stopped == (stop_at is not None)
    assert emitted == text[:limit]
