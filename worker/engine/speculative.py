"""Speculative decoding without changing the answer: proposers, exact verification, and when
to bother (no torch; the draft-model proposer, which runs a model, is draft.py).

Proposals are cheap guesses of a running sequence's next tokens. A sequence with
proposals adds its last sampled token plus the k proposals to the step's flattened batch
(k + 1 query positions over its cached prefix, model_runner.py); the target model's logits
at position j give the token the target itself samples as output token `len(output) + j`,
with that index's counter-based noise and the history output + proposals[:j]. A proposal
is accepted only while it equals that token, so the emitted tokens are those plain decoding
would emit, greedy or seeded, at any k and in any batch (`num_accepted`). After the first
mismatch the target's token there is emitted; after k accepted ones the bonus token at
position k. The rejected positions' K/V are never counted as computed (Scheduler.commit).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from worker.engine.sequence import Sequence as Seq

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


class Proposer(Protocol):
    """Where proposals come from (`--speculative ngram` or `draft`)."""

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        """At most ks[i] proposed next tokens for each running sequence seqs[i] (ks[i] >= 1)."""
        ...

    def retain(self, request_ids: Iterable[str]) -> None:
        """Drop what is kept for sequences not among these (finished, aborted, preempted)."""
        ...


class NgramProposer:
    """Prompt lookup over each sequence's prompt and output: no model, no state."""

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        return [propose_ngram(s.prompt_ids + s.output_ids, k) for s, k in zip(seqs, ks, strict=True)]

    def retain(self, request_ids: Iterable[str]) -> None:
        pass


def num_accepted(draft_ids: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many leading proposals equal the target's own tokens (target_ids has one more)."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return n


class SpeculationPolicy:
    """Who speculates this step, and how many proposals.

    Each proposal is one more row through every matmul and one more attention over the context.
    At batch 1 on a memory-bound CPU the matmuls mostly read weights, so a verify step of k + 1
    rows costs more than a one-token step but much less than k + 1 of them (measured with
    SmolLM2 on 2 cores: ~1.5x for k = 4); with many running decodes the batch already uses the
    compute and extra rows cost about their share. So:

    - per step: no speculation when more than `max_batch` sequences decode; a busy worker then
      runs exactly plain decoding and its aggregate throughput cannot get worse;
    - per sequence: an exponential moving average of the proposals it gets accepted per verify
      step (weight `alpha`). A verify step pays off only when it yields clearly more than the one
      token a plain step gives, so below `min_accepted` the sequence stops proposing; every
      `probe_interval` of its steps it proposes k once more, so a sequence whose text turns
      repetitive later (a quote, a code block) gets speculation back. Measured with
      `benchmarks/speculative.py` (3 runs, AVX2 EPYC): min_accepted 0.7 with one-token probes
      gave 1.40x on repetitive prompts, 0.93x open-ended, 0.91x at 16 concurrent; 1.0 with
      full probes 1.41x, 0.91x and 1.19x. Open-ended text still loses: not solved yet. It proposes at most
      1 + ceil(average) tokens: rows that would most likely be rejected are not computed.
    """

    def __init__(self, k: int, max_batch: int = 4, min_accepted: float = 1.0, alpha: float = 0.5,
                 probe_interval: int = 16) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.k = k
        self.max_batch = max_batch
        self.min_accepted = min_accepted
        self.alpha = alpha
        self.probe_interval = probe_interval

    def is_step_enabled(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch

    def num_proposals(self, state: SpecState) -> int:
        """How many tokens this sequence should propose this step (0: a plain decode)."""
        if state.mean_accepted < self.min_accepted:
            state.num_skipped += 1
            if state.num_skipped < self.probe_interval:
                return 0
            state.num_skipped = 0
            return self.k  # a full probe: one proposal could never lift the average past 1
        return min(self.k, 1 + math.ceil(state.mean_accepted))

    def update(self, state: SpecState, num_draft: int, num_accepted_: int) -> None:
        state.num_draft_tokens += num_draft
        state.num_accepted_tokens += num_accepted_
        state.num_drafts += 1
        state.mean_accepted = (1 - self.alpha) * state.mean_accepted + self.alpha * num_accepted_


class SpecState:
    """One sequence's speculation: this step's proposals and its counts."""

    __slots__ = ("draft_ids", "mean_accepted", "num_skipped", "num_drafts", "num_draft_tokens",
                 "num_accepted_tokens")

    def __init__(self) -> None:
        self.draft_ids: list[int] = []  # proposed for this step; [] = a plain decode
        self.mean_accepted = 1.0  # moving average of accepted proposals per verify step
        self.num_skipped = 0  # steps without proposals since the average fell low
        self.num_drafts = 0  # verify steps
        self.num_draft_tokens = 0  # proposed, over the request
        self.num_accepted_tokens = 0
