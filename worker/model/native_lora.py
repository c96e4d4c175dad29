"""The Python side of kernels/lora.c: one fused matmul's LoRA updates for all adapted rows of
a step in one C call (built by native.py; the tables' layout is lora.py's)."""

from __future__ import annotations

import ctypes

import torch

_p, _i64, _i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
TABLE_FIELDS = 12  # lora.c's lora_entry: a_t, b_t, in, N, r, m, then 3 (start, end) column ranges


class LoraKernel:
    """out[rows] += x[rows] @ a_t @ b_t with each row's adapter (kernels/lora.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.lora_add
        self._fn.restype = ctypes.c_int
        # tables, S, layer, group, x, x_stride, in, out, out_stride, N, rows, row_slots, n, T, threads
        self._fn.argtypes = [_p, _i64, _i64, _i64, _p, _i64, _i64, _p, _i64, _i64, _p, _p, _i64, _i64, _i]

    def __call__(self, tables: torch.Tensor, layer: int, group: int, x: torch.Tensor, out: torch.Tensor,
                 rows: torch.Tensor, row_slots: torch.Tensor) -> None:
        """tables (S,) int64: each slot's adapter table's address (lora.py, LoraAdapter.table);
        x (T, in), out (T, N) fp32 CPU with contiguous rows; rows (n,) int64: the adapted rows,
        sorted by slot; row_slots (n,) int64: their slots. Called ~120 times a step: only
        x and out are checked here, the rest once a step by LoraRows."""
        if x.shape[0] != out.shape[0]:
            raise ValueError(f"lora update: x {tuple(x.shape)} and out {tuple(out.shape)} differ in rows")
        for name, t in (("x", x), ("out", out)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
                raise ValueError(f"lora update: {name} must be (T, width) fp32 on the CPU with contiguous "
                                 f"rows, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
        failed = self._fn(tables.data_ptr(), tables.shape[0], layer, group, x.data_ptr(), x.stride(0),
                          x.shape[1], out.data_ptr(), out.stride(0), out.shape[1], rows.data_ptr(),
                          row_slots.data_ptr(), rows.shape[0], x.shape[0], torch.get_num_threads())
        if failed == -2:
            raise ValueError(f"lora update: a row is outside [0, {x.shape[0]}), its slot outside "
                             f"[0, {tables.shape[0]}), or its adapter's layer {layer} update does not fit "
                             f"x {tuple(x.shape)} -> out {tuple(out.shape)}")
        if failed:
            raise MemoryError("lora update: no memory for the update's scratch")


def check_rows(rows: torch.Tensor, row_slots: torch.Tensor, tables: torch.Tensor) -> None:
    """What LoraKernel reads besides x and out, checked once a step."""
    for name, t in (("rows", rows), ("row_slots", row_slots), ("tables", tables)):
        if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"lora update: {name} must be a contiguous 1-d int64 CPU tensor")
    if rows.shape != row_slots.shape:
        raise ValueError(f"lora update: rows {tuple(rows.shape)} and row_slots {tuple(row_slots.shape)} "
                         "differ")
