"""Build a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata (no torch).

A GGUF has no tokenizer.json: llama.cpp keeps the tokens, merges, token types
and the name of a pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the
Hugging Face pipeline those describe, following llama.cpp's `llama-vocab.cpp`
and transformers' `integrations/gguf/gguf_tokenizer_mapping.py`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from worker.model.gguf_meta import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, GGUFMetadata

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names -> how text is split before byte-level BPE.
#   "gpt2":   GPT-2's regex (what ByteLevel(use_regex=True) applies).
#   "digits": every digit on its own, then GPT-2's regex. This is SmolLM2's
#             tokenizer.json (Digits(individual_digits) + ByteLevel) and
#             llama.cpp's "smollm"/"starcoder" rule. transformers 5.x maps
#             "smollm" to plain GPT-2 instead, which differs on whitespace
#             before a digit ("a\n\n3": ours "\n\n","3"; theirs "\n","\n","3").
_PRE_TOKENIZERS: dict[str | None, str] = {
    None: "gpt2",  # files written before llama.cpp recorded the pre-tokenizer
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "exaone": "digits",
    "minerva": "digits",
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _pre_tokenizer(name: str | None) -> Any:
    rule = _PRE_TOKENIZERS.get(name)
    if rule is None:
        known = ", ".join(sorted(k for k in _PRE_TOKENIZERS if k))
        raise ValueError(f"GGUF pre-tokenizer {name!r} is not supported (supported: {known})")
    if rule == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == "digits":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rule), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def byte_level_bpe_from_gguf(meta: GGUFMetadata) -> Backend:
    """`tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ValueError(f"{meta.path}: GGUF byte-level BPE needs tokenizer.ggml.tokens and .merges")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        # Tokens are stored byte-level spelled; a few files store some as raw text.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for left, _, right in (m.partition(" ") for m in merges)],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [], alphabet)
    _set_post_processor(backend, meta, tokens)
    return backend


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int], alphabet: set[str]) -> None:
    """Control tokens (type 3) become special, user-defined ones (type 4) plain added tokens,
    so both are matched whole in the text instead of being cut into pieces."""
    special, added = [], []
    for token, kind in zip(tokens, types, strict=False):
        # A "control" token spelled outside the byte alphabet is a llama.cpp
        # mislabel; adding it would grow the vocabulary (transformers skips it too).
        if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_TYPE_USER_DEFINED and set(token) <= alphabet:
            added.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(added)


def _set_post_processor(backend: Backend, meta: GGUFMetadata, tokens: list[str]) -> None:
    """BOS/EOS are added only where the file asks for it; byte-level BPE defaults to no."""
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    head = [(tokens[bos], bos)] if add_bos and bos is not None else []
    tail = [(tokens[eos], eos)] if add_eos and eos is not None else []
    if not head and not tail:
        return
    single = " ".join([*(t for t, _ in head), "$A", *(t for t, _ in tail)])
    pair = " ".join([single, *(t for t, _ in head), "$B:1", *(t for t, _ in tail)])
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict(head + tail).items())
    )
