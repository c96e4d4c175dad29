"""Prefix-cache-aware routing: what a gateway and a worker both compute (protos/keys.py,
"Routing").

A request's prefix is summarised as chained hashes of its canonical text in CHUNK_CHARS
chunks: chunk i's hash covers chunks 0..i, so two requests share hash i exactly when their
texts agree up to the end of chunk i. The canonical text needs neither the tokenizer nor
the chat template, which the gateway does not have: it is the prompt itself, or the chat
messages in order, each as role, a separator, content and a terminator. A chat's next turn
(the same messages plus the answer and a new user message) then starts with the previous
turn's text, so its first hashes are the previous turn's. What the text hashes to only
approximates the worker's token blocks (the SGLang router and llm-d's approximate scorer
do the same): a wrong guess costs a cache miss, never a wrong answer, because the worker's
prefix cache still compares tokens.

The hashes are keyed by the request's cache scope (QueuedRequest.cache_scope: its tenant's
sharing group and cache salt), so tenants who do not share cached blocks never match each
other's hashes either, and routing reveals nothing that the cache would not.
"""

from __future__ import annotations

import hashlib

from protos.tokenrelay.v1 import generate_pb2

# 128 characters is ~30 SmolLM2 tokens of English, two KV blocks of 16: fine enough that a
# 300-token system prompt is ~10 chunks, coarse enough that a 32k-token prompt is ~1,000
# hashes (8 bytes each) to look up.
CHUNK_CHARS = 128
MAX_CHUNKS = 1024  # the first ~130k characters: past it, the overlap is decided anyway
HASH_BYTES = 8
_ROLE_END, _MESSAGE_END = "\x1e", "\x1f"


def canonical_text(request: generate_pb2.GenerateRequest) -> str:
    """The prompt, or the chat messages in order (see the module docstring)."""
    if request.HasField("chat"):
        return "".join(m.role + _ROLE_END + m.content + _MESSAGE_END for m in request.chat.messages)
    return request.prompt


def prefix_hashes(request: generate_pb2.GenerateRequest, cache_scope: bytes) -> list[bytes]:
    """The chained hash of each whole CHUNK_CHARS chunk of the canonical text (at most
    MAX_CHUNKS), keyed by the cache scope and the request's LoRA adapter (a worker shares
    cached blocks only within one adapter: a base model's blocks are no hit for it)."""
    text = canonical_text(request).encode()
    scope = cache_scope + b"\0lora:" + request.adapter.encode() if request.adapter else cache_scope
    key = hashlib.blake2b(scope, digest_size=32).digest()  # blake2b keys are <= 64 bytes
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(len(text), CHUNK_CHARS * MAX_CHUNKS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        previous = hashlib.blake2b(previous + text[start:start + CHUNK_CHARS], digest_size=HASH_BYTES,
                                   key=key).digest()
        hashes.append(previous)
    return hashes
