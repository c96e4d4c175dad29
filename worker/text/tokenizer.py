"""Text <-> token ids, chat templates and streaming detokenization (no torch).

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built from a GGUF
file's metadata or loaded from a folder's tokenizer.json; it matches what
transformers' tokenizer does for the same model (see `worker/gguf_tokenizer.py`
for the one deliberate difference). `IncrementalDetokenizer` turns a stream
of generated ids into UTF-8-safe text deltas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from protos.params import ChatMessage
from worker.model.gguf_meta import default_model_path, end_of_generation_ids, read_gguf_metadata
from worker.text.gguf_tokenizer import byte_level_bpe_from_gguf, bytes_to_unicode

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for bytes that are not (yet) valid UTF-8


class Tokenizer:
    """One model's vocabulary, special tokens and chat template. Build with `Tokenizer.load`."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        is_byte_level: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # bos_token/eos_token/... strings, visible to the chat template as HF passes them
        self.special_tokens = dict(special_tokens or {})
        self.is_byte_level = is_byte_level

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path | None = None) -> Tokenizer:
        """From a `.gguf` file (None = the default SmolLM2) or a Hugging Face folder."""
        path = default_model_path() if path is None else Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            return cls.from_hf_folder(path)
        raise ValueError(f"{path}: expected a .gguf file or a folder with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        meta = read_gguf_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{path}: GGUF tokenizer {kind!r} is not supported (only 'gpt2' byte-level BPE)")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        special = {}
        for name, key in names.items():
            token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                special[name] = tokens[token_id]
        return cls(
            byte_level_bpe_from_gguf(meta),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=frozenset(end_of_generation_ids(meta)),
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
            is_byte_level=True,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            name: value["content"] if isinstance(value, dict) else value
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(value := config.get(name), str | dict)
        }
        eos = special.get("eos_token")
        eos_ids: set[int] = set()
        if eos and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.add(eos_id)
        for extra in ("config.json", "generation_config.json"):  # what generation stops on
            value = _read_json(folder / extra).get("eos_token_id")
            eos_ids.update([value] if isinstance(value, int) else value or [])
        bos = special.get("bos_token")
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        return cls(
            backend,
            bos_token_id=backend.token_to_id(bos) if bos else None,
            eos_token_ids=frozenset(eos_ids),
            chat_template=_hf_chat_template(folder, config),
            special_tokens=special,
            is_byte_level=decoder.get("type") == "ByteLevel",
        )

    # ------------------------------------------------------------------ ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def vocab_difference(self, other: Tokenizer) -> str | None:
        """How `other`'s token ids differ from this one's (None: the same vocabulary)."""
        mine = self.backend.get_vocab(with_added_tokens=True)
        theirs = other.backend.get_vocab(with_added_tokens=True)
        if len(mine) != len(theirs):
            return f"{len(mine)} vs {len(theirs)} tokens"
        for token, token_id in sorted(mine.items(), key=lambda item: item[1]):
            if theirs.get(token) != token_id:
                return f"token {token!r} is id {token_id} vs {theirs.get(token)}"
        if self.eos_token_ids != other.eos_token_ids:
            return f"end-of-sequence ids {sorted(self.eos_token_ids)} vs {sorted(other.eos_token_ids)}"
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token text such as `<|im_start|>` in `text` maps to its id, as in transformers."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (byte-level vocabularies), else its UTF-8 text."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary ({self.vocab_size})")
        if self.is_byte_level and token_id not in self._added_token_ids:
            decoder = self._byte_decoder
            if all(c in decoder for c in token):
                return bytes(decoder[c] for c in token)
        return self.decode([token_id]).encode()

    def encoded_vocab(self) -> list[bytes]:
        """Every token's raw bytes by id, b"" for special tokens (what a grammar compiler needs:
        a constrained output never spells `<|im_start|>`, though a stop token may end it)."""
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return [b"" if i in special else self.token_bytes(i) for i in range(self.vocab_size)]

    def token_text(self, token_id: int) -> str:
        """Display text of one token for logprobs: a byte fragment of a multi-byte
        character shows as `\\xe6` escapes instead of U+FFFD."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="backslashreplace")

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return {c: b for b, c in bytes_to_unicode().items()}

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """Render like transformers' `apply_chat_template(..., tokenize=False)`."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: send a plain prompt instead of messages")
        try:
            return _compile_template(self.chat_template).render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's `chat_template` (a string or named list), or chat_template.jinja."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t["name"]: t["template"] for t in template}
        template = by_name.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    """Same environment as transformers: sandboxed (templates come from model files), trimmed blocks."""
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


class IncrementalDetokenizer:
    """Per-request streaming decode: `add(ids)` returns the new text, never half a character.

    Technique of vLLM/TGI `decode_token`: decode a small window (a few already
    emitted "context" tokens + the pending ones) and emit the part after the
    context's text, but only once it does not end in U+FFFD: a trailing U+FFFD
    may be the first bytes of a character that the next token completes.
    Context tokens keep decoders that depend on neighbours (sentencepiece's
    leading space) right. Cost per call is O(window), not O(sequence).

    Guarantee: the concatenation of every `add` and `flush` equals
    `tokenizer.decode(generated_ids)` (for prompt context, decoding in context:
    identical for byte-level vocabularies).
    """

    NUM_PROMPT_CONTEXT_TOKENS = 5  # as vLLM: enough for sentencepiece's space handling
    # A character has at most 4 bytes; more pending tokens than this (with room
    # for tokens that decode to nothing) means some of them hold invalid bytes.
    MAX_PENDING_TOKENS = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or ())[-self.NUM_PROMPT_CONTEXT_TOKENS :]
        self._set_context(context)
        if self._context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; its end cannot be told apart
            # from the output's start, so decode the output on its own.
            self._set_context([])

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if not text.endswith(REPLACEMENT_CHAR):
            delta = text[len(self._context_text) :]
            self._set_context(self._ids[self._num_context :])  # what was just emitted
            return delta
        if len(self._ids) - self._num_context > self.MAX_PENDING_TOKENS:
            return self._emit_settled(text)
        return ""

    def flush(self) -> str:
        """End of stream: whatever was held back, U+FFFD included."""
        delta = self._decode(self._ids)[len(self._context_text) :]
        self._set_context(self._ids[self._num_context :])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _set_context(self, context: list[int]) -> None:
        """Start a new window whose tokens are all emitted already."""
        self._ids = context  # the window: num_context emitted ids, then the pending ones
        self._num_context = len(context)
        self._context_text = self._decode(context)

    def _emit_settled(self, text: str) -> str:
        """Many pending tokens still ending in U+FFFD: the earlier ones hold invalid bytes
        that no later token can repair. Emit up to the latest cut that decodes the same
        in two halves (a cut inside a character or an invalid run would change the
        text), so the window stays small."""
        ids = self._ids
        for cut in range(len(ids) - 1, self._num_context, -1):
            head, tail = self._decode(ids[:cut]), self._decode(ids[cut:])
            if tail and head + tail == text and head.startswith(self._context_text):
                delta = head[len(self._context_text) :]
                self._set_context([])
                self._ids = ids[cut:]  # all pending: they decode alike on their own
                return delta
            if len(ids) - cut >= self.MAX_PENDING_TOKENS:
                break
        return ""
