"""Rotary position embeddings, including Hugging Face's rope_scaling variants."""

from __future__ import annotations

import math

import torch

from worker.model.config import ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """(D/2,) inverse frequencies, scaled as config.rope_scaling says."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
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
