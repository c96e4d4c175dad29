"""The quantized-linear kernels (worker/model/native_quant.py, kernels/quant.c): against NumPy
references and fp32 maths, on every instruction set this CPU has, and what they refuse."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.quant_factories import (
    FP32_EXACT,
    KINDS,
    NMSE_16BIT,
    NMSE_MAX,
    WEIGHT_MAX,
    Q,
    assert_close_to_max,
    float_linear,
    integer_weight,
    make_inputs,
    make_integer_inputs,
    make_integer_weight,
    make_weight,
    nmse,
)
from worker.model.native_quant import ISA_ENV, ISAS, QuantKernels
from worker.model.quant import (
    ACT_MAX,
    QK,
    QuantWeight,
    cat_rows,
    from_blocks,
    integer_dots_reference,
    interleave_rows,
    linear_reference,
    quantize,
    quantize_activations_reference,
)


@pytest.fixture(params=list(ISAS))
def isa(request: pytest.FixtureRequest, quant: QuantKernels) -> str:
    if request.param not in quant.supported_isas:
        pytest.skip(f"this CPU has no {request.param} (it has {', '.join(quant.supported_isas)})")
    return str(request.param)


# ---------------------------------------------------------------- activation quantization


def test_activation_quantization_equals_the_reference_with_zero_blocks_and_ties(quant: QuantKernels) -> None:
    x = make_inputs(5, 4 * QK) * 3  # (T, C)
    x[1, :QK] = 0  # an all-zero block: d = 0, q = 0
    x[2] = 0  # an all-zero row
    ties = (torch.arange(-16, 16) * 2047 + 0.5) / 8  # x / d = k + 1/2 exactly when d = 1/8, k across int16
    ties[5] = ACT_MAX / 8  # max |x| = 32767 / 8: d = 1/8 exactly
    x[3, QK:2 * QK] = ties
    x[4, 2 * QK:3 * QK] = -ties
    qs, d, s, ds = quant.quantize_activations(x)
    want_qs, want_d, want_s = quantize_activations_reference(x.numpy())
    assert qs.dtype == torch.int16 and want_qs.dtype == np.int16 and qs.shape == (5, 4 * QK)
    assert (want_qs[3, QK:2 * QK][np.arange(QK) != 5] % 2 == 0).all()  # every tie went to its even neighbour
    assert (want_d[1, 0], want_d[3, 1]) == (0.0, 0.125) and not want_qs[2].any()
    assert want_qs[3, QK + 5] == ACT_MAX and want_qs[3, QK] == -16 * 2047  # -32751.5: to the even -32752
    nonzero = np.abs(want_qs.reshape(5, 4, QK)).max(-1)[want_d != 0]  # (blocks,)
    assert (nonzero == ACT_MAX).all()  # each block's largest |x| becomes +-32767: 16 bits, not 8
    np.testing.assert_array_equal(qs.numpy(), want_qs)
    np.testing.assert_array_equal(d.numpy(), want_d)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(ds.numpy(), want_d * want_s.astype(np.float32))


# ---------------------------------------------------------------- the kernels' maths, per instruction set


def exact_integer_result(w: QuantWeight, kind: str, x: torch.Tensor) -> np.ndarray:
    """(T, N) int64: x @ w^T for an integer weight of scale 1 and inputs whose activation scale is 1."""
    qa, da, s = quantize_activations_reference(x.numpy())
    assert (da == 1).all() and (qa == x.numpy()).all()  # quantization keeps x as it is
    want = integer_dots_reference(w, qa).sum(-1)  # (T, N) int64
    if kind == "q4_0":  # w = u - 8: the kernels add m * (da * sa) = -8 * sa per block
        want = want - 8 * s.sum(-1, keepdims=True)
    return want


@pytest.mark.parametrize("T", [1, 3, 5, 17, 70])  # each input-row tile remainder, and two tasks (> 64 rows)
@pytest.mark.parametrize("kind", KINDS)
def test_integer_dot_products_are_exact(quant: QuantKernels, isa: str, kind: str, T: int) -> None:
    """With dw = da = 1 the kernels' floats are sums of integer products. Each is exact in fp32, in any
    order and grouping, when the sum of the products' magnitudes is below 2^24 (so is every partial
    sum, and the per-block int32 dots convert exactly): asserted below, so a wrong pairing, sign,
    nibble or block shows up as an exact mismatch, not a tolerance."""
    N, C = 39, 3 * QK  # 39 = 16 + 16 + 7: weight-row tiles of 4, 2 and 1
    w = make_integer_weight(kind, N, C)
    x = make_integer_inputs(T, C)
    assert float(x.abs().sum(-1).max()) * WEIGHT_MAX[kind] < FP32_EXACT  # q4_0's -8 * sa terms: 8 < 15
    want = exact_integer_result(w, kind, x)
    got = quant.linear(x, w, isa=isa)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))
    assert np.abs(want).max() > 2**16  # beyond int16: a 16-bit accumulator would wrap or saturate


@pytest.mark.parametrize("T", [1, 6])  # the one-row tiles, then 4-row tiles and a remainder
@pytest.mark.parametrize("kind", KINDS)
def test_extreme_integers_do_not_overflow(quant: QuantKernels, isa: str, kind: str, T: int) -> None:
    """q8 weight -128 and q4 nibble 15 against activations of +-32767, every product at its largest:
    the int32 sums must neither wrap nor saturate. A partial sum of k products is k * 2^7 * 32767 (q8),
    an fp32 in any order while |k| * 32767 < 2^24 (3 blocks: |k| <= 96), or k * 15 * 32767 (q4), one
    while |k| * 15 * 32767 < 2^24 (one block: |k| <= 32)."""
    C = 3 * QK if kind == "q8_0" else QK
    extreme = WEIGHT_MAX[kind] * (-1 if kind == "q8_0" else 1)
    alternate = np.where(np.arange(C) % 2 == 0, extreme, 0)  # extremes at even places only
    full = np.full(C, extreme)
    ints = np.stack([full, alternate, full, alternate[::-1], full, alternate, full])  # (7, C): tiles 4, 2, 1
    w = integer_weight(kind, ints)
    signs = [np.ones(C), -np.ones(C), np.where(np.arange(C) % 2 == 0, 1.0, -1.0)]  # +, -, alternating
    x = torch.from_numpy((ACT_MAX * np.stack(signs * 2)[:T]).astype(np.float32))  # (T, C)
    want = exact_integer_result(w, kind, x)
    assert (want.astype(np.float32).astype(np.int64) == want).all()  # every result is an fp32
    got = quant.linear(x, w, isa=isa)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))
    # the all-extreme row against +32767: q8 -128 * 32767 * 96 (beyond int16 and fp32's 2^24), q4_1 15 * 32767
    # * 32, q4_0 (15 - 8) * 32767 * 32
    assert want[0, 0] == C * ACT_MAX * {"q8_0": -128, "q4_1": 15, "q4_0": 7}[kind]


@pytest.mark.parametrize("T", [1, 6, 70])
@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_matches_scalar_and_the_reference(quant: QuantKernels, isa: str, kind: str,
                                                                 T: int) -> None:
    w = make_weight(kind, 39, 8 * QK)
    x = make_inputs(T, 8 * QK)
    got = quant.linear(x, w, isa=isa)
    assert got.shape == (T, 39) and got.dtype == torch.float32
    assert_close_to_max(got, linear_reference(w, x.numpy()))
    assert torch.equal(got, quant.linear(x, w, isa="scalar"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_gives_the_portable_c_paths_bits(quant: QuantKernels, kind: str) -> None:
    """quant.c: every path sums each block's integers whole (exact) and then does the same float
    operations in the same order, so AMX, the SIMD paths and portable C give the same bits, in
    every tile shape: 64 weight rows and 70 input rows run AMX tiles (16 x 16) for 64 of them and
    VNNI tiles for the rest; 44 weight rows end in a task of 12 that AMX does not take. Without AMX,
    9 or more input rows run the AVX-512 VNNI GEMM tile (quant_vnni.h) in groups of 6 to 12 (13
    rows: 6 + 7, 300: 256 in groups of 11 and 12, then 44 in 4 of 11), fewer the groups of
    quant_simd.h. On AVX2, 24 or more run quant_gemm8.h, 16 weight rows in groups of 4 to 6 input
    rows; the task of 12 weight rows runs quant_simd.h's tiles there."""
    bias = torch.randn(64, generator=torch.Generator().manual_seed(4))
    gate_up = interleave_rows(make_weight(kind, 38, 8 * QK, seed=1), make_weight(kind, 38, 8 * QK, seed=2))
    for N in (44, 64):
        w = make_weight(kind, N, 8 * QK)
        for T in (1, 6, 9, 13, 16, 33, 70, 300):
            x = make_inputs(T, 8 * QK)
            residual = torch.randn(T, N, generator=torch.Generator().manual_seed(T))

            def run(isa: str) -> tuple[torch.Tensor, ...]:
                return (quant.linear(x, w, bias[:N], isa=isa),  # noqa: B023
                        quant.linear(x, w, bias[:N], mode="add", out=residual.clone(), isa=isa),  # noqa: B023
                        quant.linear(x, gate_up, mode="silu_mul", isa=isa))  # noqa: B023
            want = run("scalar")
            for isa in quant.supported_isas:
                for mode, got, expected in zip(("store", "add", "silu_mul"), run(isa), want, strict=True):
                    assert torch.equal(got, expected), f"{isa}, {mode}, N = {N}, T = {T}"


def test_silu_mul_gives_every_instruction_set_the_same_bits_at_its_limits(quant: QuantKernels) -> None:
    """SwiGLU through a bias that pushes the gates past expf's clamps (+-87, +-88), to +-inf, NaN
    and +-0: the vectorised silu of the x86 tiles (quant_simd.h silu_mul8) keeps the scalar's bits."""
    specials = [0.0, -0.0, 87.5, -87.5, 88.5, -88.5, 200.0, -200.0, float("inf"), float("-inf"),
                float("nan"), 1e-30, 30.0, -30.0, 3.0, -3.0]
    gate_up = interleave_rows(make_weight("q4_1", 16, 4 * QK, seed=1),
                              make_weight("q4_1", 16, 4 * QK, seed=2))
    bias = torch.zeros(32)
    bias[0::2] = torch.tensor(specials)  # the gates
    for T in (1, 8, 30):  # one-row tiles (4 pairs a write), a group of 8, the GEMM tile (AVX2)
        x = make_inputs(T, 4 * QK)
        want = quant.linear(x, gate_up, bias, mode="silu_mul", isa="scalar")
        assert want.isnan().any() and want.isinf().any()
        for isa in quant.supported_isas:
            got = quant.linear(x, gate_up, bias, mode="silu_mul", isa=isa)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{isa}, {T} rows"


def test_the_environment_can_name_the_instruction_set(quant: QuantKernels,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.model.native import load_native_kernels
    load = load_native_kernels.__wrapped__  # the uncached loader: a fresh QuantKernels each call
    monkeypatch.setenv(ISA_ENV, "scalar")
    kernels = load()
    assert kernels is not None and kernels.quant.isa == "scalar"
    monkeypatch.setenv(ISA_ENV, "neon")
    want = f"{ISA_ENV}='neon': this CPU runs {', '.join(quant.supported_isas)}"
    with pytest.raises(ValueError, match=re.escape(want)):
        load()


def test_an_instruction_set_this_cpu_lacks_is_refused(quant: QuantKernels) -> None:
    missing = [isa for isa in ISAS if isa not in quant.supported_isas]
    if not missing:
        pytest.skip("this CPU has every instruction set the kernels know")
    w, x = make_weight("q8_0", 4, QK), make_inputs(2, QK)
    with pytest.raises(ValueError, match=f"this CPU cannot run {missing[0]}"):
        quant.linear(x, w, isa=missing[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_its_batch_or_row_stride(quant: QuantKernels, kind: str) -> None:
    w = make_weight(kind, 39, 4 * QK)
    wide = make_inputs(70, 5 * QK)  # (T, C + 32): x below is a view with strided rows
    x = wide[:, QK:]
    together = quant.linear(x, w)
    assert torch.equal(together, quant.linear(x.contiguous(), w))
    for t in (0, 3, 64, 69):
        assert torch.equal(quant.linear(x[t:t + 1], w)[0], together[t]), f"row {t}"
    gate_up = interleave_rows(make_weight(kind, 38, 4 * QK, seed=1), make_weight(kind, 38, 4 * QK, seed=2))
    fused = quant.linear(x, gate_up, mode="silu_mul")
    for T in range(1, 18):  # every group of input rows a tile takes (1..8), and splits of 9..17 rows
        assert torch.equal(quant.linear(x[:T], w), together[:T]), f"{T} rows"
        assert torch.equal(quant.linear(x[:T], gate_up, mode="silu_mul"), fused[:T]), f"{T} rows, silu_mul"


@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_linear_error_vs_fp32_is_within_llama_cpp_threshold(quant: QuantKernels, kind: str,
                                                                      T: int) -> None:
    w = make_weight(kind, 1536, 576)  # SmolLM2's gate projection
    x = make_inputs(T, 576)
    error = nmse(quant.linear(x, w), float_linear(x, w))
    assert error < NMSE_MAX
    assert error < NMSE_16BIT  # 16-bit activations: an 8-bit rounding (1e-5 and more) would fail here
    assert error > 1e-11  # the activations really were quantized (fp32 maths alone: ~5e-14): checks can fail


# ---------------------------------------------------------------- modes, bias and fused gate/up


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_bias_and_add_mode_apply_to_the_stored_result(quant: QuantKernels, kind: str, T: int) -> None:
    w, x = make_weight(kind, 39, 4 * QK), make_inputs(T, 4 * QK)
    bias = torch.randn(39, generator=torch.Generator().manual_seed(5))
    stored = quant.linear(x, w)
    assert torch.equal(quant.linear(x, w, bias), stored + bias)
    residual = torch.randn(T, 39, generator=torch.Generator().manual_seed(6))
    out = residual.clone()
    assert quant.linear(x, w, bias, mode="add", out=out) is out
    assert torch.equal(out, residual + (stored + bias))


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_silu_mul_of_interleaved_gate_and_up(quant: QuantKernels, kind: str, T: int) -> None:
    gate, up = make_weight(kind, 38, 4 * QK, seed=1), make_weight(kind, 38, 4 * QK, seed=2)
    x = make_inputs(T, 4 * QK)
    bias = torch.randn(76, generator=torch.Generator().manual_seed(7))  # interleaved: gate_i, up_i
    g = torch.from_numpy(linear_reference(gate, x.numpy())) + bias[0::2].double()  # (T, 38)
    u = torch.from_numpy(linear_reference(up, x.numpy())) + bias[1::2].double()
    got = quant.linear(x, interleave_rows(gate, up), bias, mode="silu_mul")
    assert got.shape == (T, 38)
    assert_close_to_max(got, F.silu(g) * u)
    fp32 = F.silu(float_linear(x, gate) + bias[0::2]) * (float_linear(x, up) + bias[1::2])
    assert nmse(got, fp32) < NMSE_16BIT


def test_interleave_and_cat_rows_order_whole_rows() -> None:
    a, b = make_weight("q4_1", 3, QK, seed=1), make_weight("q4_1", 3, QK, seed=2)
    da, db = a.dequantize(), b.dequantize()
    assert torch.equal(interleave_rows(a, b).dequantize(), torch.stack((da, db), dim=1).reshape(6, QK))
    assert torch.equal(cat_rows([a, b]).dequantize(), torch.cat((da, db)))
    assert torch.equal(a.rows(torch.tensor([2, 0])).dequantize(), da[[2, 0]])


# ---------------------------------------------------------------- bad inputs


Call = Callable[[QuantKernels, QuantWeight, torch.Tensor], Any]

META = torch.device("meta")  # shapes and dtypes, no data: its data_ptr() is no CPU address
FP32_ON = "must be a torch.float32 CPU tensor, got"
NOT_CONTIGUOUS = "must be (39, 96) contiguous, got (39, 96)"


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values with the same shape, column-major: not contiguous."""
    return t.t().contiguous().t()


def without_m() -> QuantWeight:
    return replace(make_weight("q4_0", 39, 3 * QK), m=None)


BAD_INPUTS: dict[str, tuple[Call, str]] = {
    "x fp64": (lambda k, w, x: k.linear(x.double(), w), f"x {FP32_ON} torch.float64 on cpu"),
    "x on meta": (lambda k, w, x: k.linear(x.to(META), w), f"x {FP32_ON} torch.float32 on meta"),
    "x 1-D": (lambda k, w, x: k.linear(x[0], w), "x must be (T, 96) with contiguous rows, got shape (96,)"),
    "x wrong in_features": (lambda k, w, x: k.linear(x[:, :64], w), "x must be (T, 96) with contiguous rows"),
    "x columns strided": (lambda k, w, x: k.linear(strided(x), w), "x must be (T, 96) with contiguous rows"),
    "add without out": (lambda k, w, x: k.linear(x, w, mode="add"), "mode 'add' needs `out`"),
    "out wrong shape": (lambda k, w, x: k.linear(x, w, out=torch.empty(3, 38)),
                        "out must be (3, 39), got (3, 38)"),
    "out fp64": (lambda k, w, x: k.linear(x, w, out=torch.empty(3, 39, dtype=torch.float64)),
                 f"out {FP32_ON} torch.float64 on cpu"),
    "out on meta": (lambda k, w, x: k.linear(x, w, out=torch.empty(3, 39, device=META)),
                    f"out {FP32_ON} torch.float32 on meta"),
    "bias wrong shape": (lambda k, w, x: k.linear(x, w, torch.zeros(38)),
                         "bias must be (39,) contiguous, got (38,)"),
    "bias fp64": (lambda k, w, x: k.linear(x, w, torch.zeros(39, dtype=torch.float64)),
                  f"bias {FP32_ON} torch.float64 on cpu"),
    "weight qs not contiguous": (lambda k, w, x: k.linear(x, replace(w, qs=strided(w.qs))),
                                 f"weight qs {NOT_CONTIGUOUS}"),
    "weight qs wrong dtype": (lambda k, w, x: k.linear(x, replace(w, qs=w.qs.view(torch.uint8))),
                              "weight qs must be a torch.int8 CPU tensor, got torch.uint8 on cpu"),
    "weight d fp64": (lambda k, w, x: k.linear(x, replace(w, d=w.d.double())),
                      "weight d must be a torch.float16 CPU tensor, got torch.float64 on cpu"),
    "weight d on meta": (lambda k, w, x: k.linear(x, replace(w, d=w.d.to(META))),
                         "weight d must be a torch.float16 CPU tensor, got torch.float16 on meta"),
    "weight qs wrong shape": (lambda k, w, x: k.linear(x, replace(w, qs=w.qs[:, :64])),
                             "weight qs must be (39, 96) contiguous, got (39, 64)"),
    "q4 weight without m": (lambda k, w, x: k.linear(x, without_m()),
                            "a q4 weight needs its block offsets m"),
    "q4 weight m not contiguous": (
        lambda k, w, x: k.linear(x, replace(make_weight("q4_0", 39, 3 * QK),
                                            m=strided(torch.zeros(39, 3, dtype=torch.float16)))),
        "weight m must be (39, 3) contiguous, got (39, 3)"),
    "ids negative": (lambda k, w, x: k.dequantize_rows(w, torch.tensor([0, -1])), "ids must be in [0, 39)"),
    "ids past the end": (lambda k, w, x: k.dequantize_rows(w, torch.tensor([39])), "ids must be in [0, 39)"),
    "dequantize out wrong shape": (lambda k, w, x: k.dequantize_rows(w, out=torch.empty(39, 64)),
                                   "dequantize_rows: out must be (39, 96) contiguous"),
    "dequantize out fp64": (lambda k, w, x: k.dequantize_rows(w, out=torch.zeros(39, 96).double()),
                            f"out {FP32_ON} torch.float64 on cpu"),
    "dequantize a weight without m": (lambda k, w, x: k.dequantize_rows(without_m()),
                                      "a q4 weight needs its block offsets m"),
    "dequantize a strided weight": (lambda k, w, x: k.dequantize_rows(replace(w, qs=strided(w.qs))),
                                    f"weight qs {NOT_CONTIGUOUS}"),
    "quantize C not a multiple of 32": (lambda k, w, x: k.quantize_activations(x[:, :40]),
                                        "quantize_activations: C must be a multiple of 32, got 40"),
    "quantize fp64": (lambda k, w, x: k.quantize_activations(x.double()),
                      f"x {FP32_ON} torch.float64 on cpu"),
    "quantize on meta": (lambda k, w, x: k.quantize_activations(x.to(META)),
                         f"x {FP32_ON} torch.float32 on meta"),
    "quantize columns strided": (lambda k, w, x: k.quantize_activations(strided(x)),
                                 "x must be (T, 96) with contiguous rows"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_value_error_naming_the_problem(quant: QuantKernels, name: str) -> None:
    """Every check runs on metadata before the C code reads any pointer: a meta tensor never reaches it."""
    call, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        call(quant, make_weight("q8_0", 39, 3 * QK), make_inputs(3, 3 * QK))


def test_silu_mul_with_an_odd_number_of_rows_is_refused(quant: QuantKernels) -> None:
    """With odd N the C epilogue would take an unset slot of the tile as the last row's 'up' and write
    out[t, N // 2], a column past `out`."""
    w, x = make_weight("q8_0", 5, QK), make_inputs(3, QK)
    padded = torch.zeros(3, 3)  # (T, N // 2 + 1): the column past `out` catches a stray write
    try:
        with pytest.raises(ValueError, match=re.escape("'silu_mul' needs an even number of weight rows "
                                                       "(gate, up interleaved), got 5")):
            quant.linear(x, w, mode="silu_mul", out=padded[:, :2])
    finally:
        assert not padded.any(), "the kernel wrote into or past `out`"


@pytest.mark.parametrize(("isa", "mode", "message"), [
    ("neon", "store", "isa must be one of amx, avx512vnni, avxvnni, avx2, scalar, got 'neon'"),
    (None, "gelu", "mode must be one of store, add, silu_mul, got 'gelu'")], ids=["isa", "mode"])
def test_unknown_isa_or_mode_names_raise_value_error(quant: QuantKernels, isa: str | None, mode: str,
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        quant.linear(make_inputs(2, QK), make_weight("q8_0", 4, QK), mode=mode, isa=isa)


def test_shapes_and_types_the_blocks_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="q8_0 needs in_features divisible by 32, got 48"):
        quantize(torch.ones(4, 48), "q8_0")
    with pytest.raises(ValueError, match="Q4_1 tensor needs in_features divisible by 32, got 48"):
        from_blocks(np.zeros((4, 30), np.uint8), Q.Q4_1, (4, 48))
    with pytest.raises(ValueError, match="F16 blocks are not kept quantized"):
        from_blocks(np.zeros((4, 64), np.uint8), Q.F16, (4, QK))
    with pytest.raises(ValueError, match=re.escape("cannot fuse weights of formats ['q4', 'q8']")):
        cat_rows([make_weight("q4_0", 2, QK), make_weight("q8_0", 2, QK)])


def test_the_int16_peak_loop_counts_its_multiply_adds_on_every_isa(quant: QuantKernels, isa: str) -> None:
    """bench-kernel-limits divides by this count: 12 accumulators x (2 x s32 lanes) a round."""
    lanes = {"amx": 0, "avx512vnni": 16, "avxvnni": 8, "avx2": 8, "scalar": 0}[isa]  # amx: no int16 loop
    assert quant.int16_peak_macs(isa, 1000, 2) == 2 * 1000 * 12 * 2 * lanes
