"""The model's matmuls: float weights through oneDNN (or F.linear), block-quantized
weights through the C kernels (kernels/quant.c), one interface for both."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.model.native_quant import QuantKernels
from worker.model.quant import QuantWeight, interleave_rows

Weight = torch.Tensor | QuantWeight
PACK_ROWS_HINT = 16  # oneDNN picks the blocked weight layout for this many rows (a decode batch)
# From this many rows on, a quantized weight is dequantized into a scratch buffer and
# multiplied in fp32 by oneDNN (on the plain, unpacked weight): prefill is bound by the
# maths, and the integer kernels, scaling every 32-value block, do less per cycle than
# oneDNN's fp32 GEMM. Measured, 1 thread, AVX2-only EPYC, SmolLM2's gate/up (3072 x 576):
# 512 rows 57 ms in the integer kernel vs 27 ms fp32; 16 rows 2.0 vs 2.1 ms. Through
# F.linear (MKL) instead of oneDNN, a 512-token prefill ran at 73 vs 336 tok/s.
# Not measured, so not used: bf16 GEMMs (4.3x fp32 where the CPU has AVX512_BF16; emulated
# and slow on the AVX2 hosts) round each activation to 8 significant bits, an error of the
# order that broke greedy parity with 8-bit activation blocks (kernels/quant.c), so they
# need a parity run as well as a speed run on such a host; and an int16 VNNI GEMM.
DEQUANTIZE_ROWS = 64


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
        self._scratch = torch.empty(0)  # fp32 dequantized weights for prefill-sized matmuls

    def prepare(self, w: Weight) -> Weight:
        """w in the layout its kernel reads (opaque: only this class reads it)."""
        if isinstance(w, QuantWeight):
            if self.quant is None:
                raise ValueError("quantized weights need the C kernels (worker/model/native.py)")
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
        if x.shape[0] >= DEQUANTIZE_ROWS:
            return self._float.linear(x, self._dequantized(w), b)
        assert self.quant is not None
        return self.quant.linear(x, w, b)

    def gate_up(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T): (T, C) -> (T, F)."""
        if not isinstance(w, QuantWeight):
            gate, up = self._float.linear(x, w).chunk(2, dim=-1)  # (T, F) each
            return F.silu(gate) * up
        if x.shape[0] >= DEQUANTIZE_ROWS:  # dequantized gate rows first, then up rows, as a float weight
            gate, up = self._float.linear(x, self._dequantized(w, _gate_then_up(w.shape[0]))).chunk(2, dim=-1)
            return F.silu(gate) * up
        assert self.quant is not None
        return self.quant.linear(x, w, mode="silu_mul")

    def _dequantized(self, w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
        """w's `rows` (all by default) as fp32 (N, C) in a scratch buffer reused by every layer."""
        assert self.quant is not None
        N, C = w.shape
        if self._scratch.numel() < N * C:
            self._scratch = torch.empty(N * C, dtype=torch.float32)
        return self.quant.dequantize_rows(w, rows, out=self._scratch[:N * C].view(N, C))


@functools.cache
def _gate_then_up(num_rows: int) -> torch.Tensor:
    """Row order 0, 2, 4, ..., 1, 3, 5, ...: an interleaved gate/up weight's gates, then its ups.
    Multiplying the interleaved rows and taking SiLU * up from strided views of the result
    made a 512-token SmolLM2 prefill ~15% slower (367 vs 421-458 tok/s, 2 threads)."""
    return torch.cat((torch.arange(0, num_rows, 2), torch.arange(1, num_rows, 2)))
