"""Which attention backend a model runs (worker/model/attn_backends.py has the seam)."""

from __future__ import annotations

import torch

from worker.model.attn_backends import AttentionBackend, CpuBackend, TorchBackend
from worker.model.flashinfer_backend import FlashInferBackend, is_available
from worker.model.native import NativeKernels

BACKENDS = ("cpu", "torch", "flashinfer")


def make_backend(name: str, kernels: NativeKernels | None, device: torch.device, num_heads: int,
                 dtype: torch.dtype) -> AttentionBackend:
    """`name` one of BACKENDS, or "auto": cpu with the C kernels, flashinfer on CUDA when it is
    installed, else torch."""
    if name == "auto":
        if kernels is not None:
            name = "cpu"
        else:
            name = "flashinfer" if device.type == "cuda" and is_available() else "torch"
    if name == "cpu":
        if kernels is None:
            raise ValueError("the cpu attention backend needs the C kernels (fp32 on CPU)")
        return CpuBackend(kernels)
    if name == "torch":
        return TorchBackend()
    if name == "flashinfer":
        return FlashInferBackend(device, num_heads, dtype)
    raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)} or auto, got {name!r}")
