"""Speculative decoding on the real SmolLM2 engine: a repetitive prompt accepts proposals, and
tokens, text, stop strings and usage are those of plain decoding."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def test_stop_string_before_the_end_of_a_run_the_engine_ended(engine: TextEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """max_tokens one past the stop string's token: the engine may end the request (LENGTH) in
    the same verified run in which the text matches the stop one token earlier; the answer is
    still the stop string's, with that token count."""
    core, num_after_end = engine.engine, []
    stop_at = core.stop_at

    def counting_stop_at(seq: Any, num_output_tokens: int, reason: FinishReason) -> None:
        num_after_end.append(seq.is_finished)
        stop_at(seq, num_output_tokens, reason)

    monkeypatch.setattr(core, "stop_at", counting_stop_at)
    for stop in ("item 3", "cherry", "date"):
        first = run(engine, SamplingParams(max_tokens=60, temperature=0.0, stop=(stop,)), False)
        assert first[-1].usage is not None and first[-1].finish_reason == FinishReason.STOP
        num_tokens = first[-1].usage.completion_tokens
        params = SamplingParams(max_tokens=num_tokens + 1, temperature=0.0, stop=(stop,))
        plain, fast = run(engine, params, False), run(engine, params, True)
        for outs in (plain, fast):
            assert outs[-1].finish_reason == FinishReason.STOP
            assert outs[-1].usage is not None and outs[-1].usage.completion_tokens == num_tokens
        assert "".join(o.text for o in fast) == "".join(o.text for o in plain)
    assert any(num_after_end)  # the engine had ended one of them already (SmolLM2 on this prompt)
