"""The workload of benchmarks/routing.py: chat sessions, each with its own document, played
turn by turn through a gateway.

A session's system message is its own ~300-token document (seeded sentences, the session number
in its first words, so no two sessions share a cacheable prefix block); each turn adds a
~40-token user message after the previous turn's answer (the text of its stream) as the
assistant message, in the chat-messages form of GenerateRequest. Everything here is the same
in every run and every configuration: the same greedy answers give the same prompts.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import grpc

from protos.convert import build_request
from protos.tokenrelay.v1 import generate_pb2

CALL_TIMEOUT_S = 600.0
DOCUMENT_SENTENCES = 19  # ~300 tokens with the SmolLM2 tokenizer (293-330 for 18-20)
QUESTION_SENTENCES = 1  # ~38 tokens, then the chat template's few

ADJECTIVES = ("quiet", "amber", "narrow", "ancient", "bright", "hollow", "frozen", "gentle", "rusty",
              "silver", "crowded", "distant", "golden", "heavy", "humble", "modern", "patient", "rapid",
              "scarlet", "tidy")
NOUNS = ("harbor", "lantern", "orchard", "bridge", "ledger", "meadow", "tower", "river", "market", "garden",
         "library", "engine", "village", "canal", "forest", "station", "mill", "valley", "island", "workshop")
VERBS = ("repairs", "measures", "guards", "paints", "follows", "records", "visits", "carries", "cleans",
         "counts", "builds", "watches", "opens", "shares", "sells", "plants", "moves", "checks", "lights",
         "fills")
TIMES = ("every morning", "at dusk", "each spring", "on Mondays", "before the rains", "after the fair",
         "twice a year", "at noon", "in winter", "during the harvest")


def sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} near the {rng.choice(NOUNS)} "
            f"{rng.choice(VERBS)} {rng.randint(2, 99)} {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}s "
            f"{rng.choice(TIMES)}.")


def document(session: int) -> str:
    """Session `session`'s system message: ~300 tokens, the same in every run, its own from its
    first words (the session number) on."""
    rng = random.Random(f"routing-document-{session}")
    body = " ".join(sentence(rng) for _ in range(DOCUMENT_SENTENCES))
    return f"Document {session}: the records of {rng.choice(NOUNS)} {session}. {body}"


def question(session: int, turn: int) -> str:
    """The user message of a session's turn: ~40 tokens."""
    rng = random.Random(f"routing-question-{session}-{turn}")
    asked = (f"Question {turn + 1}: according to the document, which {rng.choice(NOUNS)} "
             f"{rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}s, and when?")
    return " ".join([asked, *(sentence(rng) for _ in range(QUESTION_SENTENCES)), "Answer briefly."])


@dataclass
class Turn:
    session: int
    turn: int  # 0-based: turn 0 has no history to find cached
    ttft_s: float = float("nan")
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    worker_id: str = ""
    text: str = ""
    error: str = ""


async def ask(stub: Any, messages: list[tuple[str, str]], max_tokens: int, turn: Turn) -> Turn:
    """One call: the time to its first chunk, the answer as streamed, and its Final's usage."""
    request = build_request(messages=messages, max_tokens=max_tokens, temperature=0.0)
    sent = time.perf_counter()
    chunks: list[str] = []
    final: generate_pb2.Final | None = None
    async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.HasField("chunk"):
            if not chunks:
                turn.ttft_s = time.perf_counter() - sent
            chunks.append(response.chunk.text)
        else:
            final = response.final
    if final is None or final.finish_reason == generate_pb2.FINISH_REASON_ERROR:
        turn.error = final.error_message if final is not None else "no Final message"
        return turn
    turn.text = "".join(chunks)
    turn.prompt_tokens = final.usage.prompt_tokens
    turn.cached_prompt_tokens = final.usage.cached_prompt_tokens
    turn.worker_id = final.worker_id
    return turn


async def play_session(stub: Any, session: int, num_turns: int, max_tokens: int,
                       think_s: float = 0.0) -> list[Turn]:
    """The session's turns one after the other, each with the whole history, a user's reading
    time (think_s x 0.5..1.5, seeded by the session) between an answer and the next question;
    stops at an error."""
    messages = [("system", document(session))]
    turns: list[Turn] = []
    pauses = random.Random(session)
    for k in range(num_turns):
        if k:
            await asyncio.sleep(think_s * pauses.uniform(0.5, 1.5))
        messages.append(("user", question(session, k)))
        turn = Turn(session, k)
        try:
            await ask(stub, messages, max_tokens, turn)
        except grpc.aio.AioRpcError as e:
            turn.error = f"{e.code().name}: {e.details()}"
        turns.append(turn)
        if turn.error:
            break
        messages.append(("assistant", turn.text))
    return turns


async def warm_up(stub: Any, i: int) -> None:
    """A short unrelated call: the workers' first forwards (allocator, oneDNN) before anything is timed."""
    request = build_request(f"Warm-up {i}: say hello.", max_tokens=2)
    async for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        pass
