"""When speculation pays, and how many proposals (no torch).

A verify step is not free: each proposal is one more row through every matmul and one more
attention over the context. On a GPU at small batch an extra row costs next to nothing; on
the CPU kernels it costs ~25% of a one-row step (SmolLM2, 2 AVX2 cores: 14.6 ms plain,
28-32 ms with 4 proposals), and a draft model adds its own passes. So the policy weighs,
per sequence and step, what k proposals are expected to yield against what they cost:

- yield: with p the chance that a proposal is accepted, k proposals give
  1 + p + ... + p^k = (1 - p^(k+1)) / (1 - p) tokens where a plain step gives 1. p is
  estimated per sequence from its verify steps, as accepted / (accepted + rejections) over
  exponentially decaying sums (a run ends at its first rejection, so that is the maximum
  likelihood estimate), starting optimistic (SpecState);
- cost: a decode step's seconds are fitted online as a + b * rows over the recent steps
  without prompt tokens (StepCosts), and the proposer's own seconds per proposed token, d,
  are measured as well. With S sequences decoding, k more rows and proposals make the step
  (1 + k (b + d) / (a + S b)) times longer, for S + (yield - 1) tokens instead of S.

It proposes the k (up to num_speculative_tokens) with the best ratio when that beats plain
decoding by `margin`; otherwise none, and it probes with one proposal after 1, 2, 4 ... up
to `max_backoff` plain steps, so a sequence whose text turns repetitive (a quote, a code
block) gets speculation back while one that never accepts costs a row every 16 steps.
Above `max_batch` decoding sequences nobody speculates: a busy worker runs exactly plain
decoding, so its aggregate throughput cannot get worse.
"""

from __future__ import annotations

from collections import deque

from worker.engine.sequence import SpecState


class StepCosts:
    """A least-squares fit of decode steps' seconds to their rows, over the last `size` steps."""

    def __init__(self, size: int = 64) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=size)

    def add(self, num_rows: int, seconds: float) -> None:
        self.steps.append((num_rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b): a step of r rows takes a + b * r seconds (b >= 1% of a); None until steps
        of two sizes are known."""
        n = len(self.steps)
        if n < 4 or len({r for r, _ in self.steps}) < 2:
            return None
        mean_r = sum(r for r, _ in self.steps) / n
        mean_t = sum(t for _, t in self.steps) / n
        var = sum((r - mean_r) ** 2 for r, _ in self.steps)
        b = sum((r - mean_r) * (t - mean_t) for r, t in self.steps) / var
        a = max(mean_t - b * mean_r, 1e-6)
        return a, max(b, 0.01 * a)


class SpeculationPolicy:
    def __init__(self, k: int, max_batch: int = 4, margin: float = 0.05, decay: float = 0.7,
                 max_backoff: int = 16) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self.max_batch = max_batch
        self.margin = margin
        self.decay = decay  # weight of the past in the acceptance sums, per verify step
        self.max_backoff = max_backoff
        self.costs = StepCosts()
        self.proposal_seconds = 0.0  # moving average per proposed token

    def is_step_enabled(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch

    def best_k(self, p: float, num_decodes: int) -> int:
        """The number of proposals with the best expected tokens per second, 0 when none beats
        plain decoding by the margin."""
        s, fit = num_decodes, self.costs.fit()
        a, b, d = (1.0, 0.25, 0.0) if fit is None else (*fit, self.proposal_seconds)  # before a fit: 25%
        extra = (b + d) / (a + s * b)  # per proposal, the step's relative growth
        best, best_gain = 0, 1.0 + self.margin
        tokens = 1.0
        for k in range(1, self.k + 1):
            tokens += p ** k  # 1 + p + ... + p^k
            gain = (s + tokens - 1) / s / (1 + k * extra)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def num_proposals(self, state: SpecState, num_decodes: int) -> int:
        """How many tokens this sequence should propose this step (0: a plain decode)."""
        k = self.best_k(state.acceptance, num_decodes)
        if k > 0:
            state.backoff, state.num_skipped = 1, 0
            return k
        state.num_skipped += 1
        if state.num_skipped < state.backoff:
            return 0
        state.num_skipped, state.backoff = 0, min(2 * state.backoff, self.max_backoff)
        return 1  # a probe

    def update(self, state: SpecState, num_draft: int, num_accepted: int) -> None:
        """After a verify step: num_accepted of num_draft proposals were accepted."""
        state.num_draft_tokens += num_draft
        state.num_accepted_tokens += num_accepted
        state.num_drafts += 1
        state.accepted = self.decay * state.accepted + num_accepted
        state.rejected = self.decay * state.rejected + (num_accepted < num_draft)

    def record_step(self, num_rows: int, seconds: float) -> None:
        """A decode-only step of num_rows rows (proposals included) took this long."""
        self.costs.add(num_rows, seconds)

    def record_proposals(self, num_tokens: int, seconds: float) -> None:
        """The proposer took this long for num_tokens proposals (a draft model's passes)."""
        if num_tokens > 0:
            self.proposal_seconds = 0.8 * self.proposal_seconds + 0.2 * seconds / num_tokens
