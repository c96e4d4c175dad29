"""The Python side of the quantized linears in kernels/quant.c (built by native.py)."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from worker.model.quant import QK, QuantWeight

# Instruction sets, best first; the numbers are quant.h's QUANT_ISA_*.
ISAS = {"amx": 4, "avx512vnni": 3, "avxvnni": 2, "avx2": 1, "scalar": 0}
# Names the instruction set to use instead of the best one (to compare paths on one host, or to
# step around one a VM mishandles): every path gives the same bits, so only speed changes.
ISA_ENV = "TOKENRELAY_KERNEL_ISA"
FORMATS = {"q4": 0, "q8": 1, "q4p": 2, "q8p": 3}
# Instruction sets with tiles for panels (kernels/quant_panel.h, quant_panel8.h): a model loads its
# weights as panels there. Portable C reads panels too, but slowly, so a host without SIMD keeps rows.
PANEL_ISAS = ("amx", "avx512vnni", "avxvnni", "avx2")
MODES = {"store": 0, "add": 1, "silu_mul": 2}

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QuantKernels:
    """Quantized matmuls on the best instruction set this CPU has (`isa`), or a named one."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._linear = lib.quant_linear
        self._linear.restype = _i
        self._linear.argtypes = [_i, _p, _p, _p, _i64, _i64, _i, _p, _i64, _i64, _p, _p, _p, _p, _p, _i64,
                                 _p, _i, _i]
        self._quantize = lib.quantize_rows
        self._quantize.restype = None
        self._quantize.argtypes = [_p, _i64, _i64, _i64, _p, _p, _p, _p]
        self._dequantize = lib.quant_dequantize_rows
        self._dequantize.restype = None
        self._dequantize.argtypes = [_p, _p, _p, _i64, _i, _p, _i64, _p, _i]
        self._peak = lib.quant_int16_peak
        self._peak.restype = _i64
        self._peak.argtypes = [_i, _i64, _i]
        supported = lib.quant_isa_supported
        supported.restype = _i
        supported.argtypes = [_i]
        self.supported_isas = tuple(name for name, n in ISAS.items() if supported(n))
        self.isa = os.environ.get(ISA_ENV) or self.supported_isas[0]
        if self.isa not in self.supported_isas:
            raise ValueError(f"{ISA_ENV}={self.isa!r}: this CPU runs {', '.join(self.supported_isas)}")

    def linear(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
               mode: str = "store", out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
        """x (T, C) fp32, rows strided, values contiguous -> (T, N), or (T, N / 2) for
        "silu_mul" (weight rows interleaved gate, up), or added into `out` for "add"."""
        N, C = w.shape
        if mode not in MODES:
            raise ValueError(f"quantized linear: mode must be one of {', '.join(MODES)}, got {mode!r}")
        isa = isa or self.isa
        if isa not in ISAS:
            raise ValueError(f"quantized linear: isa must be one of {', '.join(ISAS)}, got {isa!r}")
        _check_rows("x", x, C)
        if mode == "silu_mul" and N % 2:
            raise ValueError(f"quantized linear: 'silu_mul' needs an even number of weight rows "
                             f"(gate, up interleaved), got {N}")
        T = x.shape[0]
        width = N // 2 if mode == "silu_mul" else N
        if out is None:
            if mode == "add":
                raise ValueError("quantized linear: mode 'add' needs `out`")
            out = torch.empty(T, width, dtype=torch.float32)  # (T, N) or (T, N / 2)
        elif out.shape != (T, width):
            raise ValueError(f"quantized linear: out must be ({T}, {width}), got {tuple(out.shape)}")
        _check_rows("out", out, width)
        if bias is not None:
            _check_cpu("bias", bias, torch.float32)
            if bias.shape != (N,) or not bias.is_contiguous():
                raise ValueError(f"quantized linear: bias must be ({N},) contiguous, got {tuple(bias.shape)}")
        qa = _activation_buffers(T, C)
        failed = self._linear(ISAS[isa], w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.m), N, C, FORMATS[w.format],
                              x.data_ptr(), x.stride(0), T, *(t.data_ptr() for t in qa), out.data_ptr(),
                              out.stride(0), _ptr(bias), MODES[mode], torch.get_num_threads())
        if failed:
            raise ValueError(f"quantized linear: this CPU cannot run {isa} "
                             f"(it has {', '.join(self.supported_isas)})")
        return out

    def int16_peak_macs(self, isa: str, iters: int, num_threads: int) -> int:
        """Run `iters` rounds of independent int16 dot products on registers (vpdpwssd, or
        vpmaddwd + vpaddd on AVX2) on each of num_threads threads: the multiply-adds done, 0 for
        "scalar". Timed by the caller, it is the machine's int16 dot peak on that ISA."""
        if isa not in self.supported_isas:
            raise ValueError(f"int16 peak: this CPU cannot run {isa} "
                             f"(it has {', '.join(self.supported_isas)})")
        return int(self._peak(ISAS[isa], iters, num_threads))

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (T, C) fp32, contiguous rows -> qs (T, C) int16, d, s, d * s (T, C / QK)."""
        T, C = x.shape
        if C % QK:
            raise ValueError(f"quantize_activations: C must be a multiple of {QK}, got {C}")
        _check_rows("x", x, C)
        qa = _activation_buffers(T, C)
        self._quantize(x.data_ptr(), x.stride(0), T, C, *(t.data_ptr() for t in qa))
        return qa

    def dequantize_rows(self, w: QuantWeight, ids: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` (n,) of w (all rows when None) as fp32 (n, C), into `out` when given."""
        N, C = w.shape
        ids = torch.arange(N) if ids is None else ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N):
            raise ValueError(f"dequantize_rows: ids must be in [0, {N})")
        n = ids.shape[0]
        if out is None:
            out = torch.empty(n, C, dtype=torch.float32)  # (n, C)
        elif out.shape != (n, C) or not out.is_contiguous():
            raise ValueError(f"dequantize_rows: out must be ({n}, {C}) contiguous")
        _check_cpu("out", out, torch.float32)
        self._dequantize(w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.m), C, FORMATS[w.format], ids.data_ptr(),
                         n, out.data_ptr(), torch.get_num_threads())
        return out


def _check_cpu(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a {dtype} CPU tensor, got {t.dtype} on {t.device}")


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    """A (rows, width) fp32 CPU matrix whose rows may be strided but whose values are contiguous."""
    _check_cpu(name, t, torch.float32)
    if t.dim() != 2 or t.shape[1] != width or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be (T, {width}) with contiguous rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _activation_buffers(T: int, C: int) -> tuple[torch.Tensor, ...]:
    nb = C // QK
    return (torch.empty(T, C, dtype=torch.int16), torch.empty(T, nb, dtype=torch.float32),  # qs, d
            torch.empty(T, nb, dtype=torch.int32), torch.empty(T, nb, dtype=torch.float32))  # s, d * s


def _ptr(t: Any) -> int | None:
    return None if t is None else t.data_ptr()
