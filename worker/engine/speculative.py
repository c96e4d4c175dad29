"""Speculative decoding without changing the answer: n-gram proposals, exact verification,
and when to bother (no torch).

Proposals are cheap guesses of a running sequence's next tokens. A sequence with
proposals runs its last sampled token plus the k proposals as one chunk of the step's
batch (k + 1 query positions over its cached prefix); the target model's logits at
position j give the token the target itself samples as output token `len(output) + j`,
with that index's counter-based noise and the history output + proposals[:j]. A proposal
is accepted only while it equals that token, so the emitted tokens are exactly those plain
decoding would emit, greedy or seeded, at any k and in any batch (`num_accepted`).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 1


def propose_ngram(token_ids: Sequence[int], k: int, max_n: int = MAX_NGRAM,
                  min_n: int = MIN_NGRAM) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, find the latest earlier occurrence of the
    last n tokens and propose the (at most k) tokens that followed it; [] when nothing matches.

    The latest occurrence rather than the first: in a repeated list or a rewritten file the
    most recent copy is the one being continued.
    """
    length = len(token_ids)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n:])
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # start + n <= length - 1: one token follows
            if token_ids[start] == first and list(token_ids[start:start + n]) == suffix:
                return list(token_ids[start + n:start + n + k])
    return []


def num_accepted(draft_ids: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many leading proposals equal the target's own tokens (target_ids has one more)."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return n


class SpeculationPolicy:
    """Who speculates this step.

    A verify chunk of k + 1 tokens costs more than a one-token decode (k more rows through every
    matmul, attention by chunk instead of the batched decode kernel). At batch 1 the matmuls
    only read weights and compute is idle, so extra rows are almost free; with many running
    decodes the batch already uses that compute and extra rows cost about their share. So:

    - per step: no speculation when more than `max_batch` sequences decode; a busy worker
      then runs exactly plain decoding and its aggregate throughput cannot get worse;
    - per sequence: an exponential moving average of its acceptance rate (accepted / proposed,
      weight `alpha` per verified step). Below `min_acceptance` the sequence stops proposing;
      every `probe_interval` of its steps it proposes once more, so a sequence whose text turns
      repetitive later (a quote, a code block) gets speculation back.
    """

    def __init__(self, k: int, max_batch: int = 4, min_acceptance: float = 0.3, alpha: float = 0.3,
                 probe_interval: int = 16) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.alpha = alpha
        self.probe_interval = probe_interval

    def is_step_enabled(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch

    def wants(self, state: SpecState) -> bool:
        if state.acceptance >= self.min_acceptance:
            return True
        state.num_skipped += 1
        if state.num_skipped >= self.probe_interval:
            state.num_skipped = 0
            return True
        return False

    def update(self, state: SpecState, num_draft: int, num_accepted_: int) -> None:
        state.num_draft_tokens += num_draft
        state.num_accepted_tokens += num_accepted_
        state.num_drafts += 1
        rate = num_accepted_ / num_draft
        state.acceptance = (1 - self.alpha) * state.acceptance + self.alpha * rate


class SpecState:
    """One sequence's speculation: this step's proposals and its counts."""

    __slots__ = ("draft_ids", "acceptance", "num_skipped", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens")

    def __init__(self) -> None:
        self.draft_ids: list[int] = []  # proposed for this step; [] = a plain decode
        self.acceptance = 1.0  # moving average of accepted / proposed; optimistic at first
        self.num_skipped = 0  # steps without proposals since the acceptance fell low
        self.num_drafts = 0  # verified steps
        self.num_draft_tokens = 0  # proposed, over the request
        self.num_accepted_tokens = 0
