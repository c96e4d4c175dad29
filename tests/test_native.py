"""The compiled CPU kernels against plain torch: decode attention and RMSNorm."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from worker.model import native
from worker.model.native import COMPILERS, DecodeAttention, NativeKernels, load_native_kernels

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: the model uses its torch path", allow_module_level=True)


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    k = load_native_kernels()
    assert k is not None, "a C compiler is present, so the kernels must build and load"
    return k


@pytest.fixture(scope="module")
def kernel(kernels: NativeKernels) -> DecodeAttention:
    return kernels.decode_attention


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: list[int], lens: list[int]) -> torch.Tensor:
    """Row by row: softmax(q k^T / sqrt(D)) v over the row's own positions."""
    H, D = q.shape[1], q.shape[2]
    K = k_cache.shape[1]
    out = []
    for b, (s, n) in enumerate(zip(slots, lens, strict=True)):
        keys = k_cache[s, :, :n].repeat_interleave(H // K, dim=0)  # (H, n, D)
        values = v_cache[s, :, :n].repeat_interleave(H // K, dim=0)
        w = torch.softmax(q[b, :, None] @ keys.transpose(1, 2) * D ** -0.5, dim=-1)  # (H, 1, n)
        out.append((w @ values)[:, 0])  # (H, D)
    return torch.stack(out)  # (B, H, D)


def make_inputs(B: int, H: int, K: int, D: int, S: int = 6, L: int = 50, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, H + K, D, generator=g)  # rows strided like the model's fused q/k
    k_cache = torch.randn(S, K, L, D, generator=g) * 3  # (S, K, L, D): scaled so softmax is peaked
    v_cache = torch.randn(S, K, L, D, generator=g)
    slots = torch.randperm(S, generator=g)[:B].tolist()
    lens = [1, L, *torch.randint(1, L + 1, (B,), generator=g).tolist()][:B]
    return qk[:, :H], k_cache, v_cache, slots, lens


def run(kernel: DecodeAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        slots: list[int], lens: list[int]) -> torch.Tensor:
    return kernel(q, k, v, torch.tensor(slots), torch.tensor(lens))


@pytest.mark.parametrize(("H", "K", "D"), [(9, 3, 64), (4, 4, 64), (8, 1, 128), (6, 2, 40)],
                         ids=["gqa-64", "mha-64", "mqa-128", "gqa-40"])
def test_matches_torch_attention_over_each_rows_own_length(kernel: DecodeAttention, H: int, K: int,
                                                           D: int) -> None:
    q, k, v, slots, lens = make_inputs(B=5, H=H, K=K, D=D)
    got = run(kernel, q, k, v, slots, lens)
    assert got.shape == (5, H, D)
    assert (got - reference(q, k, v, slots, lens)).abs().max() <= 1e-5


def test_positions_past_a_rows_length_are_never_read(kernel: DecodeAttention) -> None:
    q, k, v, slots, lens = make_inputs(B=3, H=4, K=2, D=64)
    before = run(kernel, q, k, v, slots, lens)
    for s, n in zip(slots, lens, strict=True):  # garbage (even NaN) beyond each row's keys
        k[s, :, n:] = float("nan")
        v[s, :, n:] = float("nan")
    assert torch.equal(run(kernel, q, k, v, slots, lens), before)


def test_a_rows_result_does_not_depend_on_its_batch(kernel: DecodeAttention) -> None:
    q, k, v, slots, lens = make_inputs(B=6, H=9, K=3, D=64)
    together = run(kernel, q, k, v, slots, lens)
    for b in range(6):
        alone = run(kernel, q[b:b + 1], k, v, slots[b:b + 1], lens[b:b + 1])
        assert torch.equal(alone[0], together[b]), f"row {b}"


def test_nan_in_one_row_stays_in_that_row(kernel: DecodeAttention) -> None:
    q, k, v, slots, lens = make_inputs(B=3, H=4, K=2, D=64)
    q = q.clone()
    q[1, 0, 0] = float("nan")
    got = run(kernel, q, k, v, slots, lens)
    assert got[1].isnan().any()
    assert got[[0, 2]].isfinite().all()


def test_the_build_is_cached_and_a_missing_compiler_falls_back(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    built = native._build(native.SOURCE, tmp_path)
    assert built.exists() and native._build(native.SOURCE, tmp_path) == built  # second call reuses it
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary files left behind
    monkeypatch.setattr(native, "COMPILERS", ("no-such-compiler-here",))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(tmp_path / "other") is None
    finally:
        load_native_kernels.cache_clear()


def test_a_compile_error_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(tmp_path / "cache") is None
    finally:
        load_native_kernels.cache_clear()


def test_an_unwritable_cache_folder_falls_back_to_the_temp_folder(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "read-only-home"
    real_build = native._build

    def build(source: Path, cache_dir: Path) -> Path:
        if cache_dir.is_relative_to(locked):  # as os.mkdir fails there for a non-root user
            raise PermissionError(13, "Permission denied", str(cache_dir))
        return real_build(source, cache_dir)

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    load_native_kernels.cache_clear()
    try:
        assert load_native_kernels(locked / "kernels") is not None
        assert list((tmp_path / "tmp").glob(f"tokenrelay-kernels-{os.getuid()}/*.so"))
    finally:
        load_native_kernels.cache_clear()


@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 1, 64), (1, 37, 96), (3, 5, 1)])
def test_rms_norm_matches_torch(kernels: NativeKernels, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    want = torch.rms_norm(x, w.shape, w, 1e-5)
    assert (kernels.rms_norm(x, w, 1e-5) - want).abs().max() <= 1e-5 * want.abs().max()
    strided = torch.randn(shape[0], shape[1] + 1, shape[2], generator=g)[:, 1:]  # a non-contiguous view
    assert torch.allclose(kernels.rms_norm(strided, w, 1e-5), torch.rms_norm(strided, w.shape, w, 1e-5),
                          rtol=1e-5, atol=1e-6)
