"""worker/text/tokenizer.py against transformers' tokenizer for SmolLM2, and streaming detokenization."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from protos.params import ChatMessage
from worker.text.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Ça va? Élève, naïve, façade, Ångström, straße, Fußgängerübergänge",
    "日本語のテキストとカタカナ。你好，世界！한국어 텍스트",
    "Emoji 😀👍🏽🇺🇸❤️ and a family 👨‍👩‍👧‍👦 (ZWJ), 🏳️‍🌈",
    "def foo(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "Numbers: 3.14159, 1,000,000, 12345678901234567890, -42, 1e-5, 0x1F",
    "tabs\tand\ttabs\t\t\tand   spaces    and\r\nCRLF",
    "trailing spaces   ",
    "   leading spaces",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tokenrelay<file_sep>",
    "مرحبا بالعالم — Россия и Україна",
    "\u200b zero width, \u00a0nbsp, \ufeffBOM",
    "",
]
# Whitespace before a digit: transformers 5.x builds "smollm" as plain GPT-2,
# SmolLM2's own tokenizer.json (and llama.cpp) split digits first.
DIGIT_WHITESPACE = ["a\n\n3", "  1", "x  12", "   999 ", "total:\n\n  42 items", "\t\t7"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load()


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    """transformers' tokenizer for the same GGUF (~9 s)."""
    transformers = pytest.importorskip("transformers")
    from worker.model.gguf_meta import default_model_path

    path = default_model_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def byte_ids(tok: Tokenizer) -> dict[str, list[int]]:
    """Token ids by kind: single bytes, multi-byte fragments that are not valid UTF-8, special."""
    single, partial = [], []
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        if len(raw) == 1:
            single.append(i)
        try:
            raw.decode()
        except UnicodeDecodeError:
            partial.append(i)
    return {"single": single, "partial": partial, "special": sorted(tok.backend.get_added_tokens_decoder())}


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> dict[bytes, int]:
    """token bytes -> id (plain tokens only)."""
    return {tok.token_bytes(i): i for i in reversed(range(tok.vocab_size))}


@pytest.fixture(scope="module")
def byte_token(tok: Tokenizer, byte_ids: dict[str, list[int]]) -> dict[int, int]:
    """byte value -> the id of the token that is exactly that byte."""
    return {tok.token_bytes(i)[0]: i for i in byte_ids["single"]}


def test_imports_no_torch() -> None:
    code = ("import sys, worker.text.tokenizer; "
            "assert 'torch' not in sys.modules, 'worker.text.tokenizer imports torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS + DIGIT_WHITESPACE)
def test_decode_round_trip_and_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_digits_split_like_smollm2_tokenizer_json(tok: Tokenizer, hf_tok: Any) -> None:
    original = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in CORPUS + DIGIT_WHITESPACE:
        assert tok.encode(text) == original.encode(text).ids, text
    assert [tok.token_text(i) for i in tok.encode("a\n\n3")] == ["a", "\n\n", "3"]


def test_special_tokens(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert hf_tok.eos_token_id in tok.eos_token_ids
    assert tok.eos_token_ids == {2, 0}  # <|im_end|> and <|endoftext|>
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2 adds no BOS
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.decode([1, 2, 28120], skip_special_tokens=True) == hf_tok.decode([28120])


CHATS = [
    [ChatMessage("user", "What is the capital of France?")],
    [ChatMessage("system", "You are terse."), ChatMessage("user", "Hi!")],
    [
        ChatMessage("system", "Be kind."),
        ChatMessage("user", "Tell me a joke."),
        ChatMessage("assistant", "Why did the chicken cross the road?"),
        ChatMessage("user", "Why? 🐔"),
    ],
]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[ChatMessage], add_generation_prompt: bool
) -> None:
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    expected = hf_tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.has_chat_template
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_token_text(tok: Tokenizer) -> None:
    assert tok.token_text(tok.encode(" world")[0]) == " world"
    assert tok.token_text(2) == "<|im_end|>"
    ids = tok.encode("日")  # three byte tokens, none valid UTF-8 alone
    assert "".join(tok.token_text(i) for i in ids) == "\\xe6\\x97\\xa5"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(10**6)


# ---------------------------------------------------------------- Hugging Face folders


def write_hf_folder(folder: Path, tok: Tokenizer, **config: Any) -> Path:
    folder.mkdir()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_hf_folder(tmp_path: Path, tok: Tokenizer, byte_token: dict[int, int]) -> None:
    folder = write_hf_folder(
        tmp_path / "m", tok, chat_template=tok.chat_template, bos_token="<|im_start|>",
        eos_token={"content": "<|im_end|>"},
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.load(folder)
    assert hf.bos_token_id == 1 and hf.eos_token_ids == {2, 0}
    assert hf.encode(CORPUS[4]) == tok.encode(CORPUS[4])
    assert hf.token_text(byte_token[0xE6]) == "\\xe6"
    assert hf.apply_chat_template(CHATS[2]) == tok.apply_chat_template(CHATS[2])


def test_no_chat_template_and_template_errors(tmp_path: Path, tok: Tokenizer) -> None:
    plain = Tokenizer.load(write_hf_folder(tmp_path / "plain", tok))
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(CHATS[0])
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    strict_tok = Tokenizer.load(write_hf_folder(tmp_path / "strict", tok, chat_template=strict))
    with pytest.raises(ValueError, match="user first"):
        strict_tok.apply_chat_template(CHATS[1])
    evil = "{{ messages.__class__.__mro__ }}"
    evil_tok = Tokenizer.load(write_hf_folder(tmp_path / "evil", tok, chat_template=evil))
    with pytest.raises(ValueError, match="chat template failed"):  # the sandbox refuses
        evil_tok.apply_chat_template(CHATS[0])


# ---------------------------------------------------------------- incremental detokenization


def stream(tok: Tokenizer, ids: list[int], chunk: int = 1, **kwargs: Any) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, ids, chunk)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize(
    "pieces, expected",
    [
        ([b"Hello", b" world"], ["Hello", " world", ""]),
        ([b"\xc3\xa9"], ["\u00e9", ""]),
        ([b"\xe6", b"\x97", b"\xa5"], ["", "", "\u65e5", ""]),  # held until the character is whole
        ([b"a", b"\xf0\x9f", b"\x98", b"\x80", b"b"], ["a", "", "", "\U0001f600", "b", ""]),
        ([b"\xe6", b"a"], ["", "\ufffda", ""]),  # invalid for good: the full decode has U+FFFD too
        ([b"\x97", b"\x97"], ["", "", "\ufffd\ufffd"]),  # only flush gives out a trailing U+FFFD
        # A long invalid run, then a character split over four tokens: past MAX_PENDING_TOKENS
        # the settled part of the run is let out; the last lead bytes wait for the rest.
        (
            [b"\xe6"] * 9 + [b"\xf0", b"\x9f", b"\x98", b"\x80"],
            [""] * 8 + ["\ufffd" * 8, "", "", "", "\ufffd\U0001f600", ""],
        ),
    ],
)
def test_stream_holds_partial_characters(
    tok: Tokenizer, vocab: dict[bytes, int], pieces: list[bytes], expected: list[str]
) -> None:
    assert stream(tok, [vocab[p] for p in pieces]) == expected


def test_stream_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(stream(tok, ids)) == "<|im_start|>assistant\nHi<|im_end|>"
    assert "".join(stream(tok, ids, skip_special_tokens=True)) == "assistant\nHi"


def test_stream_with_prompt_context(tok: Tokenizer, byte_token: dict[int, int]) -> None:
    prompt = tok.encode("The capital of France is")
    out = tok.encode(" Paris. 🇫🇷")
    assert "".join(stream(tok, out, prompt_ids=prompt)) == " Paris. 🇫🇷"
    dangling = [byte_token[0xE6], byte_token[0x97]]  # the prompt ends inside a character
    assert "".join(stream(tok, tok.encode(" ok"), prompt_ids=prompt + dangling)) == " ok"


def test_flush_returns_incomplete_bytes(tok: Tokenizer, byte_token: dict[int, int]) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("ab") + [byte_token[0xE6]]) == ""
    assert detok.flush() == "ab" + REPLACEMENT_CHAR


def test_invalid_bytes_do_not_grow_the_window(tok: Tokenizer, byte_token: dict[int, int]) -> None:
    """A run of lead bytes (each invalidated by the next) is emitted as it settles."""
    lead = byte_token[0xE6]
    sizes: list[int] = []
    decode = tok.decode

    class Spy(Tokenizer):
        def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
            sizes.append(len(ids))
            return decode(ids, skip_special_tokens)

    spy = Spy(tok.backend, bos_token_id=None, eos_token_ids=frozenset())
    detok = IncrementalDetokenizer(spy)
    rest = [byte_token[0x97], byte_token[0xA5]]  # completes the last 0xE6 into 日
    deltas = [detok.add([lead]) for _ in range(200)] + [detok.add(rest), detok.flush()]
    assert "".join(deltas) == tok.decode([lead] * 200 + rest)
    assert "".join(deltas).endswith(REPLACEMENT_CHAR + "日")
    assert max(sizes) <= 2 * IncrementalDetokenizer.MAX_PENDING_TOKENS + 2


# Continuations that complete any UTF-8 lead byte (E0 needs A0-BF, ED/F4 need 80-9F, F0 90-BF).
_CONTINUATIONS = [[b] * 3 for b in (0x80, 0x90, 0xA0)]


def check_stream(
    tok: Tokenizer, ids: list[int], chunk: int, skip: bool, continuations: list[list[int]]
) -> None:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    emitted = ""
    for i in range(0, len(ids), chunk):
        emitted += detok.add(ids[i : i + chunk])
        seen = ids[: i + chunk]
        now = tok.decode(seen, skip_special_tokens=skip)
        # Never emit what more tokens could still change (a U+FFFD that becomes a character).
        for more in continuations:
            assert tok.decode(seen + more, skip_special_tokens=skip).startswith(emitted)
        # ... and hold nothing back once the text so far ends cleanly.
        if not now.endswith(REPLACEMENT_CHAR):
            assert emitted == now
    emitted += detok.flush()
    assert emitted == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_property(
    tok: Tokenizer, byte_ids: dict[str, list[int]], byte_token: dict[int, int], data: st.DataObject
) -> None:
    token = st.one_of(
        st.sampled_from(byte_ids["single"]),
        st.sampled_from(byte_ids["partial"]),
        st.sampled_from(byte_ids["special"]),
        st.integers(0, tok.vocab_size - 1),
    )
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    chunk = data.draw(st.integers(1, 4), label="chunk")
    check_stream(tok, ids, chunk, skip, [[byte_token[b] for b in c] for c in _CONTINUATIONS])


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_stream_property_non_ascii_bytes(
    tok: Tokenizer, byte_ids: dict[str, list[int]], byte_token: dict[int, int], data: st.DataObject
) -> None:
    """Long runs of bytes >= 0x80, mostly invalid: exercises cutting the held-back window."""
    high = [i for b, i in byte_token.items() if b >= 0x80]  # the vocabulary has no C0, C1, F5-FF
    token = st.one_of(st.sampled_from(high), st.sampled_from(byte_ids["partial"]))
    ids = data.draw(st.lists(token, min_size=8, max_size=60), label="ids")
    chunk = data.draw(st.integers(1, 3), label="chunk")
    check_stream(tok, ids, chunk, False, [[byte_token[b] for b in c] for c in _CONTINUATIONS])
