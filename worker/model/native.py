"""Hand-written CPU kernels (C, kernels/cpu.c), compiled on first use with the machine's compiler.

Built with -march=native into a cache directory keyed by the source, the compiler
and the CPU (so a shared home on a mixed fleet never runs an illegal instruction),
then loaded with ctypes, which releases the GIL for the call. The kernels use
OpenMP; torch's CPU wheels ship GNU OpenMP as `libgomp.so.1`, so the loader
resolves ours to the runtime torch already has and both share one thread pool.
When anything is missing (no compiler, a failed build, a second OpenMP runtime)
the loader returns None and the model keeps its torch path: same maths, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model.native_layers import DecodeLayers
from worker.model.native_lora import LoraKernel
from worker.model.native_quant import QuantKernels

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
# One library; the *.h files they include are hashed into its name too.
SOURCES = (KERNELS / "cpu.c", KERNELS / "quant.c", KERNELS / "layer.c", KERNELS / "lora.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
COMPILERS = ("cc", "gcc", "clang")


class PagedDecodeAttention:
    """Attention of one new token per row over exactly that row's cached positions,
    read through the row's block table (kernels/cpu.c says how)."""

    def __init__(self, fns: dict[torch.dtype, Callable[..., int]]) -> None:
        self._fns = fns  # by cache dtype

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """q (B, H, D) fp32, rows may be strided, heads contiguous; k_cache/v_cache
        (K, num_blocks, block_size, D) contiguous, fp32, fp16 or bf16; block_tables
        (B, max_blocks) int32 contiguous; lens (B,) int32 with 1 <= lens <= max_blocks * block_size.
        Position p of row b is at block block_tables[b, p // block_size], offset p % block_size.
        Returns (B, H, D) fp32. Raises ValueError on any input the C code could not read safely."""
        fn = _check_paged_inputs(self._fns, q, k_cache, v_cache, block_tables, lens)
        B, H, D = q.shape
        K, num_blocks, block_size, _ = k_cache.shape
        out = torch.empty(B, H, D, dtype=torch.float32)  # (B, H, D)
        # lens and the used block ids are checked in C, each row before it is read: free there,
        # while the same check in torch took ~65 us a call, ~6% of one at batch 16 (400 tokens)
        failed = fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                    block_tables.data_ptr(), lens.data_ptr(), B, H, K, D, q.stride(0),
                    block_tables.stride(0), block_tables.shape[1], block_size, num_blocks,
                    D ** -0.5, torch.get_num_threads())
        if failed == -2:
            max_len = block_tables.shape[1] * block_size
            bad = ((lens < 1) | (lens > max_len)).nonzero()[:, 0].tolist()
            raise ValueError(f"paged decode attention: lens must be in [1, max_blocks * block_size = "
                             f"{max_len}], got {', '.join(f'row {b}: {lens[b].item()}' for b in bad)}")
        if failed == -3:
            raise ValueError(f"paged decode attention: block ids must be in [0, num_blocks = {num_blocks}), "
                             f"got {_bad_block_ids(block_tables, lens, block_size, num_blocks)}")
        if failed:
            raise MemoryError("paged decode attention: no memory for attention scores")
        return out


def _check_paged_inputs(fns: dict[torch.dtype, Callable[..., int]], q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, block_tables: torch.Tensor,
                        lens: torch.Tensor) -> Callable[..., int]:
    """The C function for this cache dtype, after every check on metadata (no tensor data read).
    Called 30 times a step: messages are only formatted for a failing check (~8 us a call, ~1%)."""
    problem = _paged_input_problem(fns, q, k_cache, v_cache, block_tables, lens)
    if problem is not None:
        raise ValueError(f"paged decode attention: {problem()}")
    return fns[k_cache.dtype]


def _paged_input_problem(fns: dict[torch.dtype, Callable[..., int]], q: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor,
                         lens: torch.Tensor) -> Callable[[], str] | None:
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "lens": lens}
    for name, t in tensors.items():
        if t.device.type != "cpu":
            return lambda: f"{name} must be on the CPU, got {t.device}"
    if q.dtype != torch.float32:
        return lambda: f"q must be float32, got {q.dtype}"
    if q.dim() != 3:
        return lambda: f"q must be (B, H, D), got shape {tuple(q.shape)}"
    if k_cache.dtype not in fns:
        return lambda: f"k_cache must be one of {list(fns)}, got {k_cache.dtype}"
    if v_cache.dtype != k_cache.dtype:
        return lambda: f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}"
    if k_cache.dim() != 4:
        return lambda: f"k_cache must be (K, num_blocks, block_size, D), got shape {tuple(k_cache.shape)}"
    if v_cache.shape != k_cache.shape:
        return lambda: f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return lambda: "k_cache and v_cache must be contiguous"
    B, H, D = q.shape
    K, cache_D = k_cache.shape[0], k_cache.shape[3]
    if cache_D != D:
        return lambda: f"head dim of q ({D}) != head dim of the cache ({cache_D})"
    if H == 0 or D == 0:
        return lambda: f"q must have heads and a head dim, got shape {tuple(q.shape)}"
    if K == 0 or H % K:
        return lambda: f"query heads ({H}) must be a multiple of kv heads ({K})"
    if q.stride(2) != 1 or (H > 1 and q.stride(1) != D):
        return lambda: "the heads of a row of q must be contiguous"
    for name, t in (("block_tables", block_tables), ("lens", lens)):
        if t.dtype != torch.int32:
            return lambda: f"{name} must be int32, got {t.dtype}"
        if not t.is_contiguous():
            return lambda: f"{name} must be contiguous"
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        return lambda: f"block_tables must be (B={B}, max_blocks), got shape {tuple(block_tables.shape)}"
    if lens.shape != (B,):
        return lambda: f"lens must be (B={B},), got shape {tuple(lens.shape)}"
    return None


def _bad_block_ids(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, num_blocks: int) -> str:
    """The rows using a block id outside [0, num_blocks) and those ids, for the error message."""
    num_used = (lens[:, None] + block_size - 1) // block_size  # (B, 1)
    used = torch.arange(block_tables.shape[1]) < num_used  # (B, max_blocks)
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))  # (B, max_blocks)
    rows = bad.any(dim=1).nonzero()[:, 0].tolist()
    return ", ".join(f"row {b}: {block_tables[b][bad[b]].tolist()}" for b in rows)


class RmsNorm:
    """RMSNorm over the last dim in one pass (torch's CPU rms_norm is ~6 small ops)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (..., C) fp32; weight (C,) contiguous. Returns a new (..., C) tensor."""
        if not (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
                and weight.is_contiguous() and weight.shape == x.shape[-1:]):
            raise ValueError(f"rms_norm: x (..., C) and weight (C,) must be contiguous fp32 CPU tensors, got "
                             f"x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
        x = x.contiguous()
        out = torch.empty_like(x)
        self._fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
        return out


class GreedyArgmax:
    """Greedy rows in one C call: (first index of each row's maximum, whether the row is finite)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, V) fp32 CPU, contiguous rows -> ids (B,) int64, is_finite (B,) bool; a row
        with NaN or +inf, or only -inf, gets id 0 and is_finite False (as Sampler does)."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 \
                or (logits.shape[1] > 1 and logits.stride(1) != 1):
            raise ValueError(f"greedy_argmax: logits must be (B, V) fp32 CPU with contiguous rows, got "
                             f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
        B, V = logits.shape
        ids = torch.empty(B, dtype=torch.int64)  # (B,)
        is_finite = torch.empty(B, dtype=torch.bool)  # (B,)
        self._fn(logits.data_ptr(), B, V, logits.stride(0), ids.data_ptr(), is_finite.data_ptr())
        return ids, is_finite


@dataclass(frozen=True)
class NativeKernels:
    paged_decode_attention: PagedDecodeAttention
    rms_norm: RmsNorm
    quant: QuantKernels
    decode_layers: Callable[..., DecodeLayers]  # (layers, **shapes) -> the layers' decode-step call
    lora: LoraKernel  # a matmul's LoRA updates for all adapted rows of a step
    greedy_argmax: GreedyArgmax  # the sampler's all-greedy rows


@functools.cache
def load_native_kernels(cache_dir: Path | None = None) -> NativeKernels | None:
    """The compiled kernels, or None (logged once) where they cannot be built or loaded here."""
    try:
        try:
            path = _build(SOURCES, cache_dir or _default_cache_dir())
        except OSError:  # an unwritable or read-only home (containers, CI): build in the temp folder instead
            path = _build(SOURCES, Path(tempfile.gettempdir()) / f"tokenrelay-kernels-{os.getuid()}")
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable, using torch: %s", e)
        return None
    if len(_openmp_runtimes()) > 1:  # ours did not bind to torch's: two pools would fight for cores
        log.warning("native CPU kernels disabled: two OpenMP runtimes loaded (%s)",
                    ", ".join(sorted(_openmp_runtimes())))
        return None
    attention = {dtype: getattr(lib, f"paged_decode_attention_{suffix}") for dtype, suffix in
                 ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"))}
    for fn in attention.values():
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int]
    norm = lib.rms_norm_f32
    norm.restype = None
    norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    argmax = lib.greedy_argmax_f32
    argmax.restype = None
    argmax.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
    quant = QuantKernels(lib)
    return NativeKernels(PagedDecodeAttention(attention), RmsNorm(norm), quant,
                         functools.partial(DecodeLayers, lib, quant), LoraKernel(lib), GreedyArgmax(argmax))


def _build(sources: tuple[Path, ...], cache_dir: Path) -> Path:
    compiler = next((c for c in map(shutil.which, COMPILERS) if c), None)
    if compiler is None:
        raise RuntimeError(f"no C compiler found (tried {', '.join(COMPILERS)})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [p.read_text() for p in (*sources, *sorted(KERNELS.glob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, compiler, version, *CFLAGS, _cpu_id()]).encode())
    target = cache_dir / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: processes starting together never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp, *map(str, sources)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenrelay" / "kernels"


def _cpu_id() -> str:
    """The machine and its instruction-set flags: -march=native code is only valid there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = next((ln for ln in lines if ln.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {platform.processor()} {flags}"


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {ln.split()[-1] for ln in maps if any(n in ln.rsplit("/", 1)[-1] for n in names)}
