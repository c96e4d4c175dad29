"""worker/model/arena.py: quantized weights moved into one huge-page mapping, unchanged."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tests.factories import make_hf_model, ours_from_hf
from tests.quant_factories import make_weight
from worker.model.arena import ALIGN, HUGE_PAGE, into_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps_entry(address: int) -> dict[str, str]:
    """This process's /proc/self/smaps fields for the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_weights_keep_their_values_and_move_into_one_aligned_mapping() -> None:
    weights = [make_weight("q4_1", 48, 96).panels(), make_weight("q8_0", 16, 64), make_weight("q4_0", 39, 32)]
    moved, area = into_huge_pages(weights)
    base = torch.frombuffer(area, dtype=torch.uint8).data_ptr()
    starts = []
    for w, m in zip(weights, moved, strict=True):
        assert m.format == w.format and m.shape == w.shape
        for name in ("qs", "d", "m"):
            a, b = getattr(w, name), getattr(m, name)
            if a is None:
                assert b is None
                continue
            assert torch.equal(a, b) and b.dtype == a.dtype and b.is_contiguous()
            assert base <= b.data_ptr() < base + len(area) and b.data_ptr() % ALIGN == 0
            starts.append(b.data_ptr())
    assert min(starts) % HUGE_PAGE == 0  # the first tensor opens a 2 MiB page
    assert len(set(starts)) == len(starts)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has no transparent huge pages to advise")
def test_the_mapping_is_advised_for_huge_pages() -> None:
    moved, _area = into_huge_pages([make_weight("q8_0", 64, 1024)])
    assert smaps_entry(moved[0].qs.data_ptr()).get("THPeligible") == "1"


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="no MADV_HUGEPAGE here: the model keeps its weights")
def test_a_quantized_model_keeps_its_weights_in_the_mapping_and_its_tied_head_once() -> None:
    model = ours_from_hf(make_hf_model(tie=True), quantize_to="q8_0")
    assert model._arena is not None
    base = torch.frombuffer(model._arena, dtype=torch.uint8).data_ptr()
    weights = [model.lm_head, *(getattr(layer, n) for layer in model.layers
                                for n in ("wqkv", "wo", "w_gate_up", "w_down"))]
    assert all(base <= w.qs.data_ptr() < base + len(model._arena) for w in weights)
    assert model.embed is model.lm_head
    assert model.decode_layers is not None  # built on the moved weights' addresses
