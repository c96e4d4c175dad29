"""The model's matmuls: float weights through oneDNN (or F.linear), block-quantized
weights through the C kernels (kernels/quant.c), one interface for both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.native_quant import PANEL_ISAS, QuantKernels
from worker.model.quant import PANEL, PANELS, QuantWeight, interleave_rows

Weight = torch.Tensor | QuantWeight
PACK_ROWS_HINT = 16  # oneDNN picks the blocked weight layout for this many rows (a decode batch)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)


@dataclass(frozen=True)
class LinearKernel:
    """The matmul `linear(x, w, b)` and how weights must be prepared for it (`pack`)."""

    linear: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]


def pick_linear(device: torch.device, dtype: torch.dtype) -> LinearKernel:
    """oneDNN with weights pre-packed into its blocked layout on CPU fp32, else F.linear.

    Measured on our 2-core CPUs (SmolLM2 shapes, weights streamed from DRAM as in
    a real step): a decode step's 121 matmuls at 16 rows take 60 ms packed vs
    80 ms with oneDNN on plain weights and 90 ms with BLAS (F.linear); at 1 row
    31 vs 34 vs 47 ms; prefill-sized inputs are on par. Packing is a one-off
    reorder at load time and takes no extra memory. It is the kernel
    torch.compile's CPU backend uses, but a private op, so fall back when missing.
    """
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        try:
            _onednn_linear(torch.ones(1, 2), _onednn_pack(torch.ones(3, 2)))
            return LinearKernel(_onednn_linear, _onednn_pack)
        except (RuntimeError, AttributeError):
            pass
    return LinearKernel(F.linear, lambda w: w)


class Linears:
    """`linear(x, w, b)` and the fused gate/up for every weight of one model."""

    def __init__(self, device: torch.device, dtype: torch.dtype, quant: QuantKernels | None) -> None:
        self._float = pick_linear(device, dtype)
        self.quant = quant

    def prepare(self, w: Weight) -> Weight:
        """w in the layout its kernel reads (opaque: only this class reads it)."""
        if isinstance(w, QuantWeight):
            if self.quant is None:
                raise ValueError("quantized weights need the C kernels (worker/model/native.py)")
            if self.quant.isa in PANEL_ISAS and w.format in PANELS and w.shape[0] % PANEL == 0:
                return w.panels()  # kernels/quant_panel.h: 1.2-1.9x at 1-16 rows (AVX-512 VNNI on Zen 4)
            return w
        return self._float.pack(w)

    def fuse_gate_up(self, gate: Weight, up: Weight) -> Weight:
        if isinstance(gate, QuantWeight) and isinstance(up, QuantWeight):
            return self.prepare(interleave_rows(gate, up))  # gate_i, up_i side by side for the epilogue
        if isinstance(gate, QuantWeight) or isinstance(up, QuantWeight):
            raise ValueError("gate and up projections must both be quantized or both be float")
        return self.prepare(torch.cat([gate, up], dim=0))

    def __call__(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, C) -> (T, N)."""
        if not isinstance(w, QuantWeight):
            return self._float.linear(x, w, b)
        assert self.quant is not None
        return self.quant.linear(x, w, b)

    def gate_up(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T): (T, C) -> (T, F)."""
        if not isinstance(w, QuantWeight):
            gate, up = self._float.linear(x, w).chunk(2, dim=-1)  # (T, F) each
            return F.silu(gate) * up
        assert self.quant is not None
        return self.quant.linear(x, w, mode="silu_mul")
