"""Speculative decoding without changing the answer: proposers and exact verification (no
torch; the draft-model proposer, which runs a model, is draft.py; when to bother is
spec_policy.py).

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

from collections.abc import Iterable, Sequence
from typing import Protocol

from worker.engine.sequence import Sequence as Seq

MAX_NGRAM = 4
# A single repeated token is too weak a match: with MIN_NGRAM 1, benchmarks/speculative.py
# (2-core AVX2 EPYC, runs of 2-4) gave 1.75x on repetitive prompts, 1.03x open-ended and
# 0.99x at 16 concurrent; with 2, 1.85x, 1.07x and 1.02x (acceptance 0.74 -> 0.79).
MIN_NGRAM = 2


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
