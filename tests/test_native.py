"""The compiled CPU kernels against plain torch: paged decode attention and RMSNorm."""

from __future__ import annotations

import platform
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from protos.params import SamplingParams
from tests.factories import kernels_built_with
from tests.test_sampling import make_batch
from worker.engine import sampling
from worker.engine.sampling import Sampler, SamplingRow
from worker.model.native import COMPILERS, NativeKernels, PagedDecodeAttention, load_native_kernels

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: the model uses its torch path", allow_module_level=True)

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    k = load_native_kernels()
    assert k is not None, "a C compiler is present, so the kernels must build and load"
    return k


@pytest.fixture(scope="module")
def kernel(kernels: NativeKernels) -> PagedDecodeAttention:
    return kernels.paged_decode_attention


@dataclass(frozen=True)
class PagedCache:
    k_cache: torch.Tensor  # (K, num_blocks, block_size, D), NaN wherever no row's key is
    v_cache: torch.Tensor  # (K, num_blocks, block_size, D)
    block_tables: torch.Tensor  # (B, max_blocks) int32, -1 past each row's used blocks
    lens: torch.Tensor  # (B,) int32
    keys: list[torch.Tensor]  # per row (K, n, D) fp32: the cache's values upcast, for the reference
    values: list[torch.Tensor]  # per row (K, n, D) fp32


def make_paged_cache(lengths: list[int], block_size: int, K: int = 3, D: int = 64,
                     dtype: torch.dtype = torch.float32, is_scattered: bool = True,
                     seed: int = 0) -> PagedCache:
    """Rows of the given lengths in blocks: consecutive blocks in row order, or (is_scattered) random
    physical blocks. The same seed gives the same keys and values whatever the layout."""
    g = torch.Generator().manual_seed(seed)
    keys = [(torch.randn(K, n, D, generator=g) * 3).to(dtype) for n in lengths]  # scaled: peaked softmax
    values = [torch.randn(K, n, D, generator=g).to(dtype) for n in lengths]
    num_used = [-(-n // block_size) for n in lengths]
    num_blocks = sum(num_used) + 2  # two blocks no row uses
    order = (torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1)) if is_scattered
             else torch.arange(num_blocks)).tolist()
    k_cache = torch.full((K, num_blocks, block_size, D), float("nan"), dtype=dtype)  # (K, num_blocks, bs, D)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((len(lengths), max(num_used) + 1), -1, dtype=torch.int32)  # (B, max_blocks)
    for b, n in enumerate(lengths):
        for j in range(num_used[b]):
            block, start, stop = order.pop(0), j * block_size, min(n, (j + 1) * block_size)
            block_tables[b, j] = block
            k_cache[:, block, :stop - start] = keys[b][:, start:stop]
            v_cache[:, block, :stop - start] = values[b][:, start:stop]
    return PagedCache(k_cache, v_cache, block_tables, torch.tensor(lengths, dtype=torch.int32),
                      [k.float() for k in keys], [v.float() for v in values])


def make_queries(B: int, H: int, K: int = 3, D: int = 64, seed: int = 0) -> torch.Tensor:
    qk = torch.randn(B, H + K, D, generator=torch.Generator().manual_seed(seed + 2))  # like the fused q/k
    return qk[:, :H]  # (B, H, D), rows strided


def reference(q: torch.Tensor, cache: PagedCache) -> torch.Tensor:
    """Row by row: softmax(q k^T / sqrt(D)) v over the row's own positions, fp32."""
    H, D = q.shape[1], q.shape[2]
    G = H // cache.k_cache.shape[0]
    out = []
    for b, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        keys, values = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)  # (H, n, D)
        w = torch.softmax(q[b, :, None] @ keys.transpose(1, 2) * D ** -0.5, dim=-1)  # (H, 1, n)
        out.append((w @ values)[:, 0])  # (H, D)
    return torch.stack(out)  # (B, H, D)


def run(kernel: PagedDecodeAttention, q: torch.Tensor, cache: PagedCache) -> torch.Tensor:
    return kernel(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens)


def lengths_for(block_size: int) -> list[int]:
    """One token, exactly one block, exactly three, and lengths ending mid-block."""
    return [1, block_size, 3 * block_size, 45, 70]


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 32, 64])
@pytest.mark.parametrize(("H", "K", "D"), [(9, 3, 64), (4, 4, 64), (8, 1, 128), (6, 2, 40)],
                         ids=["gqa-64", "mha-64", "mqa-128", "gqa-40"])
def test_matches_torch_attention_over_each_rows_own_blocks(kernel: PagedDecodeAttention, H: int, K: int,
                                                           D: int, block_size: int,
                                                           dtype: torch.dtype) -> None:
    cache = make_paged_cache(lengths_for(block_size), block_size, K, D, dtype)
    q = make_queries(5, H, K, D)
    got = run(kernel, q, cache)
    assert got.shape == (5, H, D) and got.dtype == torch.float32
    assert (got - reference(q, cache)).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(("block_size", "D"), [(1, 64), (16, 64), (16, 128), (32, 40), (64, 64)])
def test_scattered_blocks_give_bit_for_bit_the_contiguous_result(kernel: PagedDecodeAttention,
                                                                 block_size: int, D: int,
                                                                 dtype: torch.dtype) -> None:
    lengths = [1, block_size, 2 * block_size, 3 * block_size + 1, 200, 7]
    contiguous = make_paged_cache(lengths, block_size, 3, D, dtype, is_scattered=False)
    scattered = make_paged_cache(lengths, block_size, 3, D, dtype, is_scattered=True)
    assert not torch.equal(contiguous.block_tables, scattered.block_tables)
    q = make_queries(len(lengths), 9, 3, D)
    assert torch.equal(run(kernel, q, scattered), run(kernel, q, contiguous))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_a_rows_result_does_not_depend_on_its_batch(kernel: PagedDecodeAttention, dtype: torch.dtype) -> None:
    cache = make_paged_cache([1, 16, 300, 33, 2, 64], block_size=16, dtype=dtype)
    q = make_queries(6, 9)
    together = run(kernel, q, cache)
    for b in range(6):
        alone = kernel(q[b:b + 1], cache.k_cache, cache.v_cache, cache.block_tables[b:b + 1],
                       cache.lens[b:b + 1])
        assert torch.equal(alone[0], together[b]), f"row {b}"


def test_a_shorter_length_reads_only_its_prefix(kernel: PagedDecodeAttention) -> None:
    cache = make_paged_cache([40], block_size=16)
    q = make_queries(1, 9)
    short = replace(cache, lens=torch.tensor([20], dtype=torch.int32),
                    keys=[cache.keys[0][:, :20]], values=[cache.values[0][:, :20]])
    assert (run(kernel, q, short) - reference(q, short)).abs().max() <= 1e-5


def test_nan_in_one_row_stays_in_that_row(kernel: PagedDecodeAttention) -> None:
    cache = make_paged_cache([5, 40, 17], block_size=16, K=2)
    q = make_queries(3, 4, 2).clone()
    q[1, 0, 0] = float("nan")
    got = run(kernel, q, cache)
    assert got[1].isnan().any()
    assert got[[0, 2]].isfinite().all()


def every_16_bit_value(dtype: torch.dtype) -> PagedCache:
    """All 65536 fp16/bf16 bit patterns as values of one-token rows (block size 1) whose keys are 0:
    each row's softmax weight is exactly 1, so the output is the cache's values converted to fp32."""
    values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)  # (65536,)
    v_cache = values.reshape(1, 1024, 1, 64)  # (K, num_blocks, block_size, D)
    block_tables = torch.arange(1024, dtype=torch.int32)[:, None]  # (B, 1)
    return PagedCache(torch.zeros_like(v_cache), v_cache, block_tables, torch.ones(1024, dtype=torch.int32),
                      [], [v.float() for v in v_cache[0, :, None]])


def assert_converts_every_value_exactly(kernel: PagedDecodeAttention, dtype: torch.dtype) -> None:
    cache = every_16_bit_value(dtype)
    got = run(kernel, torch.ones(1024, 1, 64), cache)[:, 0]  # (1024, 64)
    want = torch.stack(cache.values)[:, 0, 0]  # (1024, 64)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_fp16_and_bf16_value_converts_exactly(kernel: PagedDecodeAttention, dtype: torch.dtype) -> None:
    assert_converts_every_value_exactly(kernel, dtype)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx is an x86 flag")
def test_the_portable_build_without_avx_or_f16c_is_correct(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    portable = kernels_built_with("-mno-avx", tmp_path, monkeypatch)  # also turns off F16C, FMA, AVX2
    for dtype in (torch.float16, torch.bfloat16):
        assert_converts_every_value_exactly(portable.paged_decode_attention, dtype)
    for D in (64, 40):
        cache = make_paged_cache(lengths_for(16), 16, 3, D, torch.float16)
        q = make_queries(5, 9, 3, D)
        assert (run(portable.paged_decode_attention, q, cache) - reference(q, cache)).abs().max() <= 1e-5


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_an_avx2_build_gives_this_hosts_bits(kernel: PagedDecodeAttention, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's floats have one order on every x86 host with FMA (per-key chains of 8 lanes,
    fixed-order softmax sums): an AVX2-only build gives this host's bits."""
    avx2 = kernels_built_with("-mno-avx512f", tmp_path, monkeypatch)
    for D, dtype in ((64, torch.float32), (128, torch.float16), (64, torch.bfloat16)):
        cache = make_paged_cache(lengths_for(16), 16, 3, D, dtype)
        q = make_queries(5, 9, 3, D)
        assert torch.equal(run(avx2.paged_decode_attention, q, cache), run(kernel, q, cache)), (D, dtype)


Change = Callable[[dict[str, torch.Tensor]], None]


def set_to(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Change:
    def change(args: dict[str, torch.Tensor]) -> None:
        args[name] = make(args[name])
    return change


def set_item(name: str, index: tuple[int, ...], value: int) -> Change:
    def change(args: dict[str, torch.Tensor]) -> None:
        args[name] = args[name].clone()
        args[name][index] = value
    return change


BAD_INPUTS: dict[str, tuple[Change, str]] = {
    "q fp64": (set_to("q", lambda t: t.double()), "q must be float32"),
    "q 2-D": (set_to("q", lambda t: t[:, 0]), "q must be (B, H, D)"),
    "q heads strided": (set_to("q", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
                        "heads of a row of q must be contiguous"),
    "q on meta": (set_to("q", lambda t: t.to("meta")), "q must be on the CPU"),
    "q head dim": (set_to("q", lambda t: t[..., :32]), "head dim of q (32) != head dim of the cache (64)"),
    "q heads not a multiple": (set_to("q", lambda t: t[:, :8]),
                               "query heads (8) must be a multiple of kv heads (3)"),
    "cache fp64": (lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
                   "k_cache must be one of"),
    "v dtype": (set_to("v_cache", lambda t: t.half()), "v_cache dtype torch.float16 != k_cache dtype"),
    "v shape": (set_to("v_cache", lambda t: t[:-1]), "v_cache shape"),
    "k 3-D": (set_to("k_cache", lambda t: t[0]), "k_cache must be (K, num_blocks, block_size, D)"),
    "k strided": (set_to("k_cache", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
                  "k_cache and v_cache must be contiguous"),
    "block_tables int64": (set_to("block_tables", lambda t: t.long()), "block_tables must be int32"),
    "block_tables strided": (set_to("block_tables", lambda t: t.t().contiguous().t()),
                             "block_tables must be contiguous"),
    "block_tables rows": (set_to("block_tables", lambda t: t[:-1]), "block_tables must be (B=3, max_blocks)"),
    "lens int64": (set_to("lens", lambda t: t.long()), "lens must be int32"),
    "lens shape": (set_to("lens", lambda t: t[:, None]), "lens must be (B=3,)"),
    "lens 0": (set_item("lens", (1,), 0), "lens must be in [1, max_blocks * block_size = 64], got row 1: 0"),
    "lens past the table": (set_item("lens", (2,), 65),
                            "lens must be in [1, max_blocks * block_size = 64], got row 2: 65"),
    "block id negative": (set_item("block_tables", (1, 1), -5),
                          "block ids must be in [0, num_blocks = 8), got row 1: [-5]"),
    "block id too large": (set_item("block_tables", (2, 0), 8),
                           "block ids must be in [0, num_blocks = 8), got row 2: [8]"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_inputs_raise_value_error_naming_the_problem(kernel: PagedDecodeAttention, name: str) -> None:
    cache = make_paged_cache([5, 40, 17], block_size=16)  # 1 + 3 + 2 blocks used + 2 spare; max_blocks 4
    args = {"q": make_queries(3, 9), "k_cache": cache.k_cache, "v_cache": cache.v_cache,
            "block_tables": cache.block_tables, "lens": cache.lens}
    change, message = BAD_INPUTS[name]
    change(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernel(**args)


def test_block_ids_past_a_rows_used_blocks_are_not_checked_or_read(kernel: PagedDecodeAttention) -> None:
    cache = make_paged_cache([5, 40, 17], block_size=16)
    q = make_queries(3, 9)
    padded = replace(cache, block_tables=cache.block_tables.clone())
    padded.block_tables[0, 1:] = 10 ** 9  # row 0 uses one block; row 1 three; row 2 two
    padded.block_tables[2, 2:] = -7
    assert torch.equal(run(kernel, q, padded), run(kernel, q, cache))


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


@pytest.mark.parametrize(("x", "weight"), [(torch.ones(2, 8), torch.ones(7)),
                                           (torch.ones(2, 8).double(), torch.ones(8)),
                                           (torch.ones(2, 8), torch.ones(16)[::2])],
                         ids=["short weight", "fp64", "strided weight"])
def test_rms_norm_rejects_what_it_cannot_read(kernels: NativeKernels, x: torch.Tensor,
                                              weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="rms_norm: x"):
        kernels.rms_norm(x, weight, 1e-5)


# -- greedy argmax --------------------------------------------------------------------------------

def test_greedy_argmax_gives_what_the_torch_sampler_gives_on_any_row(kernels: NativeKernels) -> None:
    vocab = 1000
    logits = torch.randn(9, vocab + 24)[:, :vocab]  # (9, V): strided rows
    logits[1, [7, 500, 999]] = 50.0  # a tie: the first index wins
    logits[2, 3] = float("nan")
    logits[3, 900] = float("inf")
    logits[4] = float("-inf")  # no finite token
    logits[5, :] = -3.0  # all equal
    logits[6, 998:] = float("-inf")
    logits[7, 0] = float("-inf")
    logits[8, 999] = 1e30  # the last index
    batch = make_batch([SamplingParams(temperature=0.0)] * 9, vocab)
    want = Sampler()(logits, batch)
    got = Sampler(kernels.greedy_argmax)(logits, batch)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    finite = [True, True, False, False, False, True, True, True, True]
    assert got.is_finite.tolist() == want.is_finite.tolist() == finite
    assert got.token_ids[1] == 7 and got.token_ids[8] == 999


def test_the_sampler_keeps_its_torch_path_where_a_greedy_argmax_is_not_enough(
        kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both entries: a built batch (__call__), and rows (sample), which builds the batch only for
    the torch path and otherwise gives what that batch would have given."""
    calls: list[int] = []

    def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits.shape[0])
        return kernels.greedy_argmax(logits)

    built: list[int] = []
    build = sampling.build_sampling_batch

    def counted(rows: list[SamplingRow], *args: Any) -> sampling.SamplingBatch:
        built.append(len(rows))
        return build(rows, *args)

    monkeypatch.setattr(sampling, "build_sampling_batch", counted)
    logits = torch.randn(2, 50)
    greedy = SamplingParams(temperature=0.0)
    outputs = [[1, 2], [3]]
    for params in ([greedy, SamplingParams(temperature=0.7)],  # one row samples
                   [greedy, SamplingParams(temperature=0.0, repetition_penalty=1.3)],  # a penalty
                   [greedy, SamplingParams(temperature=0.0, presence_penalty=0.5)],
                   [greedy, SamplingParams(temperature=0.0, logprobs=True)]):  # logprobs
        rows = [SamplingRow(p, 7, [4], out) for p, out in zip(params, outputs, strict=True)]
        want = Sampler(argmax)(logits, build(rows, 50, "cpu"))
        built.clear()
        got = Sampler(argmax).sample(logits, rows, "cpu")
        assert built == [2] and got.token_ids.tolist() == want.token_ids.tolist()
    assert calls == []
    rows = [SamplingRow(greedy, 7, [4], out) for out in outputs]
    want = Sampler()(logits, build(rows, 50, "cpu"))
    built.clear()
    got = Sampler(argmax).sample(logits, rows, "cpu")
    assert built == [] and calls == [2] and got.token_ids.tolist() == want.token_ids.tolist()
    Sampler(argmax)(logits, make_batch([greedy, greedy], 50))
    assert calls == [2, 2]
    with pytest.raises(ValueError, match="fp32 CPU"):
        kernels.greedy_argmax(torch.randn(2, 50, dtype=torch.float64))
