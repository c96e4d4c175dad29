"""q4p, Q4 weights in panels of 16 rows (worker/model/quant.py `panels`, kernels/quant_panel.h): the
layout itself, what it refuses, and that every instruction set gives a panel weight the bits the
row-major weight gets from portable C, on every tile shape and in a whole model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.factories import forward_in_chunks, make_hf_model, ours_from_hf
from tests.quant_factories import (
    ACT_MAX,
    KINDS,
    WEIGHT_MAX,
    integer_weight,
    make_inputs,
    make_integer_inputs,
    make_weight,
)
from worker.model import linear
from worker.model.native_quant import PANEL_ISAS, QuantKernels
from worker.model.quant import PANEL, QK, QuantWeight, integer_dots_reference

Q4_KINDS = ("q4_0", "q4_1")


def panel_word(w: QuantWeight, n: int, k: int) -> int:
    """Nibble of weight k of row n read straight from q4p's bytes, as kernels/quant.h documents it."""
    nb = w.shape[1] // QK
    b, i = divmod(k, QK)
    s, j, e = i // 8, (i % 8) // 2, i % 2
    words = w.qs.numpy().view("<u2").reshape(-1)
    return int(words[(((n // PANEL) * nb + b) * 4 + s) * 32 + (n % PANEL) * 2 + e] >> (4 * j)) & 0x0F


@pytest.mark.parametrize("kind", Q4_KINDS)
def test_panels_hold_every_weight_where_the_layout_says_and_convert_back(kind: str) -> None:
    rng = np.random.default_rng(0)
    ints = rng.integers(0, 16, size=(48, 3 * QK))
    rows = integer_weight(kind, ints)
    rows = QuantWeight("q4", rows.source, rows.qs, torch.randn(48, 3).half(), torch.randn(48, 3).half())
    p = rows.panels()
    assert p.format == "q4p" and p.shape == rows.shape and p.nbytes == rows.nbytes
    for n, k in [(0, 0), (15, 31), (16, 8), (17, 37), (47, 95), (33, 70)]:
        assert panel_word(p, n, k) == ints[n, k]
    assert all(panel_word(p, n, k) == ints[n, k] for n in range(48) for k in range(3 * QK))
    assert float(p.d[1, 2, 3]) == float(rows.d[16 + 3, 2]) and float(p.m[2, 0, 15]) == float(rows.m[47, 0])
    back = p.row_major()
    assert back.format == "q4" and all(torch.equal(a, b) for a, b in ((back.qs, rows.qs), (back.d, rows.d),
                                                                      (back.m, rows.m)))
    assert torch.equal(p.dequantize(), rows.dequantize())
    assert torch.equal(p.rows(torch.tensor([40, 3])).dequantize(), rows.dequantize()[[40, 3]])
    qa = np.asarray(make_integer_inputs(2, 3 * QK), np.int64)
    np.testing.assert_array_equal(integer_dots_reference(p, qa), integer_dots_reference(rows, qa))


def test_q8_panels_hold_every_weight_where_the_layout_says_and_convert_back() -> None:
    rng = np.random.default_rng(1)
    ints = rng.integers(-128, 128, size=(32, 2 * QK))
    rows = integer_weight("q8_0", ints)
    p = rows.panels()
    assert p.format == "q8p" and p.m is None and p.shape == rows.shape and p.nbytes == rows.nbytes
    q = p.qs.numpy()  # (P, nb, 512): [k, r, e] = weight 2 k + e of row 16 p + r
    assert all(q[n // PANEL, k // QK, (k % QK // 2) * 32 + (n % PANEL) * 2 + k % 2] == ints[n, k]
               for n in range(32) for k in range(2 * QK))
    back = p.row_major()
    assert back.format == "q8" and torch.equal(back.qs, rows.qs) and torch.equal(back.d, rows.d)
    assert torch.equal(p.dequantize(), rows.dequantize())


def test_panels_are_refused_where_they_cannot_be() -> None:
    with pytest.raises(ValueError, match="a q4 or q8 weight with a multiple of 16 rows, got q4 with 39"):
        make_weight("q4_1", 39, QK).panels()
    with pytest.raises(ValueError, match="got q4p with 32"):
        make_weight("q4_1", 32, QK).panels().panels()
    p = make_weight("q4_1", 32, QK).panels()
    with pytest.raises(ValueError, match=r"weight d must be \(2, 1, 16\) contiguous"):
        QuantWeight("q4p", "Q4_1", p.qs, p.d[:, :, :8].contiguous(), p.m)
    with pytest.raises(ValueError, match="a q4p weight needs its block offsets m"):
        QuantWeight("q4p", "Q4_1", p.qs, p.d, None)


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_gives_a_panel_weight_the_row_major_bits(quant: QuantKernels,
                                                                       kind: str) -> None:
    """AVX-512: 1 to 8 input rows run quant_panel.h's tiles (groups of up to 8: 9 rows would be 5 +
    4), 9 or more the GEMM tile from the panel's words (quant_vnni.h; AMX where the CPU has it).
    AVX2 and AVX-VNNI: up to 23 rows quant_panel8.h's tiles, in passes of up to 8, 24 or more the
    AVX2 GEMM tile (quant_gemm8.h). Portable C reads panels too. Each against portable C on
    row-major blocks: the same floats in the same order."""
    bias = torch.randn(64, generator=torch.Generator().manual_seed(4))
    gate_up = make_weight(kind, 64, 5 * QK, seed=1)
    for N in (48, 64):
        rows = make_weight(kind, N, 5 * QK)
        p = rows.panels()
        for T in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 300):
            x = make_inputs(T, 5 * QK)
            residual = torch.randn(T, N, generator=torch.Generator().manual_seed(T))

            def run(w: QuantWeight, gu: QuantWeight, isa: str) -> tuple[torch.Tensor, ...]:
                return (quant.linear(x, w, bias[:N], isa=isa),  # noqa: B023
                        quant.linear(x, w, bias[:N], mode="add", out=residual.clone(), isa=isa),  # noqa: B023
                        quant.linear(x, gu, mode="silu_mul", isa=isa))  # noqa: B023
            want = run(rows, gate_up, "scalar")
            for isa in quant.supported_isas:
                got_all = run(p, gate_up.panels(), isa)
                for mode, got, expected in zip(("store", "add", "silu_mul"), got_all, want, strict=True):
                    assert torch.equal(got, expected), f"{isa}, {mode}, N = {N}, T = {T}"


@pytest.mark.parametrize("num_threads", [1, 3, 4])
def test_panels_split_between_any_number_of_threads_give_the_same_bits(quant: QuantKernels,
                                                                      num_threads: int) -> None:
    """With few input rows each thread takes one run of whole panels (quant.c): 3 panels on 1, 3
    or 4 threads (one thread with none) give what portable C gives on rows."""
    rows = make_weight("q4_1", 48, 5 * QK, seed=7)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for T in (1, 5):
            x = make_inputs(T, 5 * QK)
            want = quant.linear(x, rows, isa="scalar")
            for isa in quant.supported_isas:
                assert torch.equal(quant.linear(x, rows.panels(), isa=isa), want), f"{isa}, T = {T}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("T", [1, 2, 6, 12])  # tiles of 4, 2 and 1 partial dots a row, and the GEMM tile
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_extreme_integers_in_panels_do_not_overflow(quant: QuantKernels, kind: str, T: int) -> None:
    """Nibble 15 (q8: -128) against +-32767 everywhere: whole blocks of the largest products, split
    over a tile's partial dots, must neither wrap nor saturate an int32 (128 * 32767 * 32 < 2^31)."""
    extreme = WEIGHT_MAX[kind] * (-1 if kind == "q8_0" else 1)
    w = integer_weight(kind, np.full((16, QK), extreme)).panels()
    signs = np.where(np.arange(T)[:, None] % 2 == 0, 1.0, -1.0) * np.ones((T, QK))
    x = torch.from_numpy((ACT_MAX * signs).astype(np.float32))  # (T, QK)
    want = np.repeat(signs[:, :1] * extreme * ACT_MAX * QK, 16, axis=1).astype(np.float32)
    for isa in quant.supported_isas:
        np.testing.assert_array_equal(quant.linear(x, w, isa=isa).numpy(), want, err_msg=isa)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_a_model_on_panels_computes_the_row_major_models_bits(monkeypatch: pytest.MonkeyPatch,
                                                              kind: str) -> None:
    """A model whose kernels read panels (AVX-512 VNNI, AMX) gives the logits and K/V of one that
    does not, in a prompt chunk (the GEMM tile) and decoding (the panel tiles); a host without SIMD
    has them forced, in portable C. Its tied embedding is the head's one copy, in panels."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2, tie=True)
    monkeypatch.setattr(linear, "PANEL_ISAS", ())
    rows = ours_from_hf(hf, quantize_to=kind)
    monkeypatch.setattr(linear, "PANEL_ISAS", (*PANEL_ISAS, "avxvnni", "avx2", "scalar"))
    panels = ours_from_hf(hf, quantize_to=kind)
    formats = {(a.w_gate_up.format, b.w_gate_up.format)
               for a, b in zip(rows.layers, panels.layers, strict=True)}
    assert formats == {(kind[:2], kind[:2] + "p")}
    assert panels.embed is panels.lm_head and panels.lm_head.format == rows.lm_head.format + "p"
    ids = torch.randint(0, rows.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    (logits, cache), (logits_p, cache_p) = (forward_in_chunks(m, ids, [30, 1]) for m in (rows, panels))
    assert torch.equal(logits, logits_p)
    assert torch.equal(cache.k, cache_p.k) and torch.equal(cache.v, cache_p.v)
