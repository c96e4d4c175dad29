"""Process memory hygiene for loading large weights on CPU (glibc malloc)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
M_MMAP_THRESHOLD = -3
LOADING_MMAP_THRESHOLD = 64 * 1024
SERVING_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's own upper bound for its dynamic threshold
SERVING_TRIM_THRESHOLD = 256 * 1024 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") else None
    except OSError:
        return None


@contextlib.contextmanager
def weights_loading() -> Iterator[None]:
    """Load weights with every allocation >= 64 KB on mmap, then switch to serving settings.

    While loading, glibc raises its mmap threshold after the first large free,
    and hundreds of MB of freed staging buffers stay on the heap (measured:
    +200 MB RSS for SmolLM2 fp32). A low fixed threshold returns them to the
    OS. Serving wants the opposite: activations of a few hundred KB to a few
    MB are allocated and freed every layer, and if each is a fresh mmap every
    op page-faults (measured: prefill ~1.5x slower). So afterwards large
    thresholds keep them on a heap that is neither unmapped nor trimmed.
    A no-op where glibc is not the allocator.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, SERVING_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM_THRESHOLD)
