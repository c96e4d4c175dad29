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

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "cpu.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
COMPILERS = ("cc", "gcc", "clang")


class DecodeAttention:
    """Attention of one new token per row over exactly that row's cached positions."""

    def __init__(self, fn: Callable[..., int]) -> None:
        self._fn = fn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """q (B, H, D) fp32, rows may be strided; k_cache/v_cache (S, K, L, D) contiguous;
        slot_ids, lens (B,) int64 with 1 <= lens <= L. Returns (B, H, D)."""
        B, H, D = q.shape
        S, K, L, _ = k_cache.shape
        assert q.stride(2) == 1 and q.stride(1) == D, "heads of a row must be contiguous"
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
        assert slot_ids.dtype == lens.dtype == torch.int64
        assert slot_ids.is_contiguous() and lens.is_contiguous()
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)  # (B, H, D)
        failed = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                          slot_ids.data_ptr(), lens.data_ptr(), B, H, K, D, q.stride(0),
                          K * L * D, L * D, D ** -0.5, torch.get_num_threads())
        if failed:
            raise MemoryError("decode attention: no memory for attention scores")
        return out


class RmsNorm:
    """RMSNorm over the last dim in one pass (torch's CPU rms_norm is ~6 small ops)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (..., C) fp32; weight (C,) contiguous. Returns a new (..., C) tensor."""
        assert x.dtype == weight.dtype == torch.float32 and weight.is_contiguous()
        x = x.contiguous()
        out = torch.empty_like(x)
        self._fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
        return out


@dataclass(frozen=True)
class NativeKernels:
    decode_attention: DecodeAttention
    rms_norm: RmsNorm


@functools.cache
def load_native_kernels(cache_dir: Path | None = None) -> NativeKernels | None:
    """The compiled kernels, or None (logged once) where they cannot be built or loaded here."""
    try:
        try:
            path = _build(SOURCE, cache_dir or _default_cache_dir())
        except PermissionError:  # a read-only home (containers, CI): build in the temp folder instead
            path = _build(SOURCE, Path(tempfile.gettempdir()) / f"tokenrelay-kernels-{os.getuid()}")
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable, using torch: %s", e)
        return None
    if len(_openmp_runtimes()) > 1:  # ours did not bind to torch's: two pools would fight for cores
        log.warning("native CPU kernels disabled: two OpenMP runtimes loaded (%s)",
                    ", ".join(sorted(_openmp_runtimes())))
        return None
    attention = lib.decode_attention_f32
    attention.restype = ctypes.c_int
    attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    norm = lib.rms_norm_f32
    norm.restype = None
    norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    return NativeKernels(DecodeAttention(attention), RmsNorm(norm))


def _build(source: Path, cache_dir: Path) -> Path:
    compiler = next((c for c in map(shutil.which, COMPILERS) if c), None)
    if compiler is None:
        raise RuntimeError(f"no C compiler found (tried {', '.join(COMPILERS)})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source.read_text(), compiler, version, *CFLAGS, _cpu_id()]).encode())
    target = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: processes starting together never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(source)],
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
