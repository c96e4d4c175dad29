"""The Python side of kernels/layer.c: all decoder layers of a step in one C call, every new
token a decode row (prompt tokens too: attention.rows_as_decodes)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from worker.model.native_quant import FORMATS, ISAS, QuantKernels
from worker.model.quant import QuantWeight

_i64, _p, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Weight(ctypes.Structure):
    _fields_ = [("qs", _p), ("d", _p), ("m", _p), ("N", _i64), ("C", _i64), ("format", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("wqkv", _Weight), ("wo", _Weight), ("wgu", _Weight), ("wdown", _Weight), ("bqkv", _p),
                ("bo", _p), ("attn_norm", _p), ("mlp_norm", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("x", _p), ("B", _i64), ("C", _i64), ("H", _i64), ("KH", _i64), ("D", _i64), ("F", _i64),
                ("eps", _f), ("scale", _f), ("cos", _p), ("sin", _p), ("num_positions", _i64),
                ("positions", _p), ("slot_mapping", _p), ("block_tables", _p), ("block_table_stride", _i64),
                ("max_blocks", _i64), ("lens", _p), ("k_cache", _p), ("v_cache", _p), ("layer_bytes", _i64),
                ("num_blocks", _i64), ("block_size", _i64), ("cache_dtype", ctypes.c_int)]


def _weight(w: QuantWeight) -> _Weight:
    return _Weight(w.qs.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), *w.shape,
                   FORMATS[w.format])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLayers:
    """Every layer of one model over a step of decode rows, on the quantized weights it was built
    with (which must stay alive: the C side keeps their addresses)."""

    def __init__(self, lib: ctypes.CDLL, quant: QuantKernels, layers: list[Any], *, hidden: int, heads: int,
                 kv_heads: int, head_dim: int, ffn: int, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self._fn = lib.decode_layers
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int, _p, _i64, _p, ctypes.c_int]
        self._quant = quant
        self._layers = (_Layer * len(layers))(*[
            _Layer(_weight(w.wqkv), _weight(w.wo), _weight(w.w_gate_up), _weight(w.w_down), _ptr(w.bqkv),
                   _ptr(w.bo), w.attn_norm.data_ptr(), w.mlp_norm.data_ptr()) for w in layers])
        self._keep = (layers, cos, sin)
        self._step = _Step(C=hidden, H=heads, KH=kv_heads, D=head_dim, F=ffn, eps=eps, scale=head_dim ** -0.5,
                           cos=cos.data_ptr(), sin=sin.data_ptr(), num_positions=cos.shape[0])

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, lens: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, isa: str | None = None) -> None:
        """x (B, C) fp32 contiguous, updated in place; positions, slot_mapping (B,) int64;
        block_tables (B, M) int32 contiguous rows; lens (B,) int32; k_cache/v_cache
        (L, K, N, Bs, D) contiguous."""
        B = x.shape[0]
        if not (x.is_contiguous() and x.dtype == torch.float32 and x.shape[1] == self._step.C):
            raise ValueError(f"decode layers: x must be (B, {self._step.C}) fp32 contiguous")
        index_args = (("positions", positions, torch.int64), ("slot_mapping", slot_mapping, torch.int64),
                      ("lens", lens, torch.int32))
        for name, t, dtype in index_args:
            if t.dtype != dtype or t.shape != (B,) or not t.is_contiguous():
                raise ValueError(f"decode layers: {name} must be ({B},) {dtype} contiguous")
        if block_tables.dtype != torch.int32 or block_tables.shape[0] != B or block_tables.stride(1) != 1:
            raise ValueError(f"decode layers: block_tables must be ({B}, M) int32 with contiguous rows")
        if k_cache.dtype not in CACHE_DTYPES or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode layers: the caches must be contiguous fp32, fp16 or bf16")
        st = self._step
        st.x, st.B = x.data_ptr(), B
        st.positions, st.slot_mapping = positions.data_ptr(), slot_mapping.data_ptr()
        st.block_tables, st.block_table_stride = block_tables.data_ptr(), block_tables.stride(0)
        st.max_blocks, st.lens = block_tables.shape[1], lens.data_ptr()
        st.k_cache, st.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        st.layer_bytes = k_cache[0].numel() * k_cache.element_size()
        st.num_blocks, st.block_size = k_cache.shape[2], k_cache.shape[3]
        st.cache_dtype = CACHE_DTYPES[k_cache.dtype]
        failed = self._fn(ISAS[isa or self._quant.isa], self._layers, len(self._layers), ctypes.byref(st),
                          torch.get_num_threads())
        if failed:
            raise ValueError({-1: "decode layers: unsupported instruction set, or no memory",
                              -2: "decode layers: a context length is outside [1, max_blocks * block_size]",
                              -3: "decode layers: a used block id is outside the cache",
                              -4: "decode layers: a position is outside the rope tables or a slot "
                                  "outside the cache",
                              }.get(failed, f"decode layers failed ({failed})"))
