"""When speculation pays (worker/engine/spec_policy.py): the cost fit, the choice of k, the
acceptance estimate and the probes."""

from __future__ import annotations

import pytest

from worker.engine.sequence import SpecState
from worker.engine.spec_policy import SpeculationPolicy, StepCosts


def test_step_costs_fit_a_line_once_two_sizes_are_known() -> None:
    costs = StepCosts(size=8)
    for _ in range(4):
        costs.add(1, 0.010)
    assert costs.fit() is None  # one size only: no slope yet
    for rows in (5, 5, 3, 9):
        costs.add(rows, 0.008 + 0.002 * rows)
    fit = costs.fit()
    assert fit is not None and fit == pytest.approx((0.008, 0.002))
    costs.add(1, 0.010)  # noise that makes a slope negative is clamped
    for _ in range(7):
        costs.add(2, 0.001)
    fit = costs.fit()
    assert fit is not None and fit[1] == pytest.approx(0.01 * fit[0])


def policy_with_costs(a: float, b: float, k: int = 4, **kw: float) -> SpeculationPolicy:
    policy = SpeculationPolicy(k, **kw)  # type: ignore[arg-type]
    for rows in (1, 2, 5, 1, 5, 2):
        policy.record_step(rows, a + b * rows)
    return policy


@pytest.mark.parametrize(("b", "p", "expected"), [
    (0.0, 0.9, 4),  # rows nearly free (a GPU at batch 1): all k
    (0.25, 0.95, 4),  # CPU rows (a proposal adds 20% to a step), repetitive text
    (0.25, 0.7, 3),  # 1.58x expected at k = 3, 1.54x at 4
    (0.25, 0.3, 1),  # 1.3 tokens for 1.2x the time
    (0.25, 0.15, 0),  # open text: plain decoding
    (2.0, 0.5, 0),  # rows dearer than the rest of the step
])
def test_best_k_weighs_yield_against_cost(b: float, p: float, expected: int) -> None:
    assert policy_with_costs(1.0, b).best_k(p, num_decodes=1) == expected


def test_a_batch_dilutes_the_gain_and_a_costly_proposer_counts() -> None:
    policy = policy_with_costs(1.0, 0.25)
    assert policy.best_k(0.8, num_decodes=1) > 0
    assert policy.best_k(0.8, num_decodes=4) < policy.best_k(0.8, num_decodes=1)
    assert policy.is_step_enabled(4) and not policy.is_step_enabled(5)
    for _ in range(20):
        policy.record_proposals(4, 4 * 1.0)  # a draft model as slow as the target
    assert policy.best_k(0.95, num_decodes=1) == 0


def test_acceptance_estimate_and_probes_with_backoff() -> None:
    policy = policy_with_costs(1.0, 0.25, max_backoff=4)
    state = SpecState()
    assert state.acceptance == pytest.approx(0.8)  # optimistic at first
    assert policy.num_proposals(state, 1) > 0
    for _ in range(6):
        policy.update(state, 4, 0)  # rejected at once, again and again
    assert state.acceptance < 0.2
    assert (state.num_drafts, state.num_draft_tokens, state.num_accepted_tokens) == (6, 24, 0)
    # probes of one proposal after 1, 2, 4, 4, ... plain steps
    assert [policy.num_proposals(state, 1) for _ in range(14)] == [1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]
    for _ in range(3):
        policy.update(state, 1, 1)  # the text turned repetitive: probes accepted
    policy.update(state, 4, 4)
    assert policy.num_proposals(state, 1) == 4 and state.backoff == 1
