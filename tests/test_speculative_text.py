"""Speculative decoding on the real SmolLM2 engine: a repetitive prompt accepts proposals, and
tokens, text, stop strings and usage are those of plain decoding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from protos.params import FinishReason, PromptInput, SamplingParams
from worker.engine.outputs import RequestOutput
from worker.engine.spec_policy import SpeculationPolicy
from worker.engine.text_engine import TextEngine

LIST = "\n".join(f"- item {i}: {fruit}" for i, fruit in enumerate(
    ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape", "honeydew"] * 2))
PROMPT = f"Repeat the following list exactly.\n\n{LIST}\n\nThe list again:\n"


@pytest.fixture
def engine(smollm_engine: TextEngine) -> Iterator[TextEngine]:
    """The session's shared engine; speculation switched on and off per call of `run`."""
    yield smollm_engine
    smollm_engine.engine.spec = None


class AlwaysK(SpeculationPolicy):
    """Always k proposals. A margin alone is not enough: the best k still follows the measured
    step costs, so on a loaded machine the runs (and which request ends inside one) vary."""

    def best_k(self, p: float, num_decodes: int) -> int:
        return self.k


def run(engine: TextEngine, params: SamplingParams, speculative: bool) -> list[RequestOutput]:
    # always speculating: these tests are about what verification does, not about when to speculate
    engine.engine.spec = AlwaysK(4) if speculative else None
    engine.add_request("r", PromptInput(prompt=PROMPT), params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_repetitive_prompt_accepts_proposals_and_changes_nothing(engine: TextEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = run(engine, params, speculative=False)
    fast = run(engine, params, speculative=True)
    assert [t for o in fast for t in o.token_ids] == [t for o in plain for t in o.token_ids]
    assert "".join(o.text for o in fast) == "".join(o.text for o in plain)
    usage = fast[-1].usage
    assert usage is not None and usage.completion_tokens == 40
    assert 0 < usage.num_accepted_tokens <= usage.num_draft_tokens
    assert len(fast) < len(plain)  # fewer steps: several tokens per step
    assert plain[-1].usage is not None and plain[-1].usage.num_draft_tokens == 0


def test_stop_string_inside_an_accepted_run(engine: TextEngine) -> None:
    text = "".join(o.text for o in run(engine, SamplingParams(max_tokens=40, temperature=0.0), False))
    stop = "item 3"
    assert stop in text
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))
    plain, fast = run(engine, params, False), run(engine, params, True)
    assert plain[-1].finish_reason == fast[-1].finish_reason == FinishReason.STOP
    assert "".join(o.text for o in fast) == "".join(o.text for o in plain) == text[:text.index(stop)]
    assert [t for o in fast for t in o.token_ids] == [t for o in plain for t in o.token_ids]
    assert fast[-1].usage is not None and plain[-1].usage is not None
    assert fast[-1].usage.completion_tokens == plain[-1].usage.completion_tokens


def run_counting_dropped(engine: TextEngine, params: SamplingParams) -> tuple[list[RequestOutput], int]:
    """`run` with speculation, and how many tokens the last step verified past the last one it
    emitted: the accepted proposals (plus the target's token) a stop dropped."""
    engine.engine.spec = AlwaysK(4)
    engine.add_request("r", PromptInput(prompt=PROMPT), params)
    outs: list[RequestOutput] = []
    num_kept = 0
    while engine.has_unfinished():
        num_accepted = engine.engine.num_spec_accepted_tokens
        outs.extend(engine.step())
        num_kept = engine.engine.num_spec_accepted_tokens - num_accepted + 1
    return outs, num_kept - len(outs[-1].token_ids)


def test_stop_string_before_the_end_of_a_verified_run(engine: TextEngine) -> None:
    """max_tokens one past the stop string's token: the verified run in which the text matches the
    stop may go on to the token that would end it at max_tokens; the answer is still the stop
    string's, with that token count."""
    num_dropped = []
    for stop in ("item 3", "cherry", "date"):
        first = run(engine, SamplingParams(max_tokens=60, temperature=0.0, stop=(stop,)), False)
        assert first[-1].usage is not None and first[-1].finish_reason == FinishReason.STOP
        num_tokens = first[-1].usage.completion_tokens
        params = SamplingParams(max_tokens=num_tokens + 1, temperature=0.0, stop=(stop,))
        plain = run(engine, params, False)
        fast, dropped = run_counting_dropped(engine, params)
        num_dropped.append(dropped)
        for outs in (plain, fast):
            assert outs[-1].finish_reason == FinishReason.STOP
            assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == num_tokens
        assert "".join(o.text for o in fast) == "".join(o.text for o in plain)
    assert any(num_dropped)  # a run went past the stop in one of them (SmolLM2 on this prompt)
