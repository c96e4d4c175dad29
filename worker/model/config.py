"""Hyper-parameters of a Llama-family decoder, independent of file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face `rope_scaling` dict (e.g. {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}); None = plain RoPE. The supported
    # types are rope.py's table; the loaders check a config against it.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V for every layer (multiply by dtype size / 4 otherwise)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
