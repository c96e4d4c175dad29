"""Rotary position embeddings, including Hugging Face's rope_scaling variants."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from worker.model.config import ModelConfig


def _linear_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    return inv_freq / float(s["factor"])


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class _RopeType(NamedTuple):
    needs: tuple[str, ...]  # the rope_scaling keys it reads
    scale: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]  # inv_freq (D/2,) -> (D/2,)


# The one table of supported Hugging Face `rope_type`s; the loaders check against it.
_ROPE_TYPES = {
    "default": _RopeType((), lambda inv_freq, s: inv_freq),
    "linear": _RopeType(("factor",), _linear_scale),
    "llama3": _RopeType(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                        _llama3_scale),
}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_TYPES)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The `rope_type` of a rope_scaling dict (`type` in older configs); "default" for none."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    """ValueError naming the rope type if it is not supported, or a key it needs that is missing."""
    kind = rope_type(scaling)
    if kind not in _ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    missing = [key for key in _ROPE_TYPES[kind].needs if key not in (scaling or {})]
    if missing:
        raise ValueError(f"rope_scaling type {kind!r} needs {', '.join(missing)}")


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """(D/2,) inverse frequencies, scaled as config.rope_scaling says."""
    check_rope_scaling(config.rope_scaling)
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (D/2,)
    return _ROPE_TYPES[rope_type(config.rope_scaling)].scale(inv_freq, config.rope_scaling or {})


def rope_tables(config: ModelConfig, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables, each (max_len, D): row p rotates position p.

    Hugging Face's half-split layout rotates x = [x1, x2] into
    [x1 cos - x2 sin, x2 cos + x1 sin]. With the sign folded into the table
    (sin_signed = [-sin, sin]) that is x * cos + [x2, x1] * sin_signed, one op
    fewer per call on the decode hot path.
    """
    inv_freq = inv_frequencies(config)  # (D/2,)
    pos = torch.arange(max_len, dtype=torch.float32)  # (L,)
    freqs = torch.outer(pos, inv_freq)  # (L, D/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # (L, D)
    sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # (L, D)
    return cos.to(device), sin_signed.to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D); cos/sin_signed (B, T, 1, D) → rotated x (B, T, H, D)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [x2, x1]
    return x * cos + swapped * sin_signed
