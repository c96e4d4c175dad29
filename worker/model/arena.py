"""Quantized weights moved into one memory mapping backed by 2 MiB pages (transparent huge pages).

A batch-1 decode step streams every weight once (SmolLM2: 96 MB). In 4 KiB pages that is
~24,000 pages a step, far more than the CPU's TLB holds, so nearly every page costs a page walk.
On a 2-core AMD EPYC Zen 4 (2026-12-07, a standalone loop of the panel tiles over SmolLM2's 120
layer matrices, 4 alternated runs of 50 passes) the same weights streamed at 25-30 GB/s in 4 KiB
pages and 37-44 GB/s in one mapping advised MADV_HUGEPAGE (best passes 36-41 against 50-52).
Linux's default `madvise` mode gives huge pages only where a program asks, hence the advice.
Where the kernel declines, the weights still move into one mapping and nothing changes but their
address; a system without MADV_HUGEPAGE does not move them (llama.py).
"""

from __future__ import annotations

import mmap
from dataclasses import replace

import torch

from worker.model.quant import QuantWeight

HUGE_PAGE = 2 << 20  # bytes
ALIGN = 64  # each tensor starts on a cache line


def _tensors(w: QuantWeight) -> dict[str, torch.Tensor]:
    return {name: t for name, t in (("qs", w.qs), ("d", w.d), ("m", w.m)) if t is not None}


def into_huge_pages(weights: list[QuantWeight]) -> tuple[list[QuantWeight], mmap.mmap]:
    """The same weights (equal values, in order) with every tensor copied into one anonymous
    mapping advised for huge pages, and the mapping (its tensors hold it; kept for clarity)."""
    sizes = [(t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for w in weights
             for t in _tensors(w).values()]
    length = -(-(sum(sizes) + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE  # room to start on a 2 MiB boundary
    area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(area, dtype=torch.uint8)  # (length,): shares the mapping's memory
    start = -flat.data_ptr() % HUGE_PAGE  # a multiple of the 4 KiB page the mapping starts on
    if hasattr(mmap, "MADV_HUGEPAGE"):  # advice before the first touch: faults then take 2 MiB pages
        try:
            area.madvise(mmap.MADV_HUGEPAGE, start, length - start)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    moved, at = [], start
    for w in weights:
        parts = {}
        for name, t in _tensors(w).items():
            n = t.numel() * t.element_size()
            parts[name] = flat[at:at + n].view(t.dtype).view(t.shape)
            parts[name].copy_(t)
            at += (n + ALIGN - 1) // ALIGN * ALIGN
        moved.append(replace(w, qs=parts["qs"], d=parts["d"], m=parts.get("m")))
    return moved, area
