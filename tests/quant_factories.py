"""Factories and bounds shared by the quantized-linear tests (tests/test_native_quant.py,
tests/test_quant.py)."""

from __future__ import annotations

import functools
import shutil

import gguf
import numpy as np
import pytest
import torch

from worker.model.native import COMPILERS
from worker.model.quant import (
    ACT_MAX,
    QK,
    QuantWeight,
    from_blocks,
    quantize,
)

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: quantized weights cannot run", allow_module_level=True)

Q = gguf.GGMLQuantizationType
KINDS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}  # GGUF block types the kernels run as they are
NMSE_MAX = 5e-4  # llama.cpp's test-backend-ops threshold for a quantized matmul
# What 16-bit activations promise: rounding to steps of max|x| / 32767 gives an NMSE of ~4e-10 on Gaussian
# inputs (8-bit ones, steps 258 times coarser, gave 1e-5 and more)
NMSE_16BIT = 1e-6
CPU = torch.device("cpu")


def pack_blocks(kind: str, ints: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """GGUF raw blocks (N, C / 32 * block bytes) uint8 of integers (N, C) (q8_0: q in [-128, 127];
    q4: u in [0, 15], q4_0 meaning d * (u - 8)), scales d (N, C / 32) and, for q4_1, offsets m."""
    N, C = ints.shape
    nb = C // QK
    parts: list[np.ndarray] = [d.astype(np.float16).reshape(N, nb, 1).view(np.uint8)]  # (N, nb, 2)
    if kind == "q4_1":
        assert m is not None
        parts.append(m.astype(np.float16).reshape(N, nb, 1).view(np.uint8))
    if kind == "q8_0":
        parts.append(ints.astype(np.int8).reshape(N, nb, QK).view(np.uint8))  # (N, nb, 32)
    else:
        u = ints.astype(np.uint8).reshape(N, nb, QK)
        parts.append(u[..., :QK // 2] | (u[..., QK // 2:] << 4))  # (N, nb, 16): byte j = u_j | u_{j+16} << 4
    return np.concatenate(parts, axis=-1).reshape(N, -1)


WEIGHT_MAX = {"q8_0": 128, "q4_0": 15, "q4_1": 15}  # the largest |integer| in a block (q8: -128, q4: u = 15)
FP32_EXACT = 2**24  # every integer of magnitude up to this is an fp32


def integer_weight(kind: str, ints: np.ndarray) -> QuantWeight:
    """Integers (N, C) (q8_0: q; q4: u) as a weight of scale 1 and offset 0 (q4_0: -8, as always)."""
    N, C = ints.shape
    nb = C // QK
    return from_blocks(pack_blocks(kind, ints, np.ones((N, nb)), np.zeros((N, nb))), KINDS[kind], (N, C))


def make_integer_weight(kind: str, N: int, C: int, seed: int = 0) -> QuantWeight:
    """Scale 1, offset 0 (q4_0: -8), random integers over the whole range; row 0 all at the extreme
    (u = 15, q = -128)."""
    rng = np.random.default_rng(seed)
    low, high = (-128, 128) if kind == "q8_0" else (0, 16)
    ints = rng.integers(low, high, size=(N, C))
    ints[0] = -128 if kind == "q8_0" else 15
    return integer_weight(kind, ints)


def make_integer_inputs(T: int, C: int, seed: int = 0, small: int = 300) -> torch.Tensor:
    """Integers with |x| = ACT_MAX (32767) once per block, at a random place and sign, and in
    [-small, small] elsewhere: the activation scale is exactly 1 and quantization keeps x as it is.
    With small = 300 and 3 blocks, sum |x| over a row stays below 2^24 / 128: see
    test_integer_dot_products_are_exact."""
    rng = np.random.default_rng(seed + 1)
    nb = C // QK
    x = rng.integers(-small, small + 1, size=(T, nb, QK))
    at = rng.integers(0, QK, size=(T, nb))  # where each block's extreme sits
    np.put_along_axis(x, at[..., None], rng.choice([-ACT_MAX, ACT_MAX], size=(T, nb, 1)), axis=-1)
    return torch.from_numpy(x.reshape(T, C).astype(np.float32))


@functools.cache
def make_weight(kind: str, N: int, C: int, seed: int = 0) -> QuantWeight:
    """A random weight (scaled like a trained linear's) in kind's blocks, from llama.cpp's quantizer."""
    w = torch.randn(N, C, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind == "q4_1":  # not one of quantize()'s targets, but what GGUF files (SmolLM2's) hold
        return from_blocks(gguf.quants.quantize(w.numpy(), Q.Q4_1), Q.Q4_1, (N, C))
    return quantize(w, kind)


def make_inputs(T: int, C: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, C, generator=torch.Generator().manual_seed(seed + 100))  # (T, C)


def float_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x (T, C) @ w^T with the dequantized weight in float64: what the quantized activations approximate."""
    return x.double() @ w.dequantize().double().T  # (T, N)


def nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want) ** 2).sum() / (want**2).sum())


def assert_close_to_max(got: torch.Tensor, want: np.ndarray | torch.Tensor, rtol: float = 1e-5) -> None:
    want = torch.as_tensor(want, dtype=torch.float64)
    err = (got.double() - want).abs().max()
    assert err <= rtol * want.abs().max(), f"max error {err:.3g} vs max |ref| {want.abs().max():.3g}"


