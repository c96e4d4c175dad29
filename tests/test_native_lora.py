"""kernels/lora.c: a matmul's LoRA updates for all adapted rows in one call equal the torch
per-row path's, and each row's bits do not depend on the rows, adapters or threads beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.lora_factories import lora_key, write_adapter
from worker.model.config import ModelConfig
from worker.model.lora import GROUPS, LoraAdapter, LoraRows, load_adapter, module_shapes
from worker.model.native import COMPILERS, load_native_kernels
from worker.model.native_lora import LoraKernel

if not any(shutil.which(c) for c in COMPILERS):
    pytest.skip("no C compiler on this machine: LoRA uses its torch path", allow_module_level=True)

CONFIG = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
# ranks and adapted modules differ per adapter: some matmuls have no update for some adapters
ADAPTERS = ((4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            (8, ("q_proj", "up_proj")), (16, ("v_proj", "o_proj", "down_proj")))
SLOTS = [2, -1, 0, 1, 0, 0, -1, 2, 1, 0, 0, 0, 2, -1, 1]  # (T,): some base rows, runs longer than a chunk


@pytest.fixture(scope="module")
def kernel() -> LoraKernel:
    k = load_native_kernels()
    assert k is not None, "a C compiler is present, so the kernels must build and load"
    return k.lora


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoraAdapter, ...]:
    g = torch.Generator().manual_seed(0)
    loaded = []
    for n, (r, modules) in enumerate(ADAPTERS):
        tensors = {}
        for i in range(CONFIG.num_layers):
            for m in modules:
                out, inp = module_shapes(CONFIG)[m]
                tensors[lora_key(i, m, "A")] = torch.randn(r, inp, generator=g)
                tensors[lora_key(i, m, "B")] = torch.randn(out, r, generator=g)
        folder = write_adapter(Path(tmp_path_factory.mktemp(f"a{n}")), tensors, r=r, alpha=2 * r)
        loaded.append(load_adapter(f"a{n}", folder, CONFIG))
    return tuple(loaded)


def widths(group: str) -> tuple[int, int]:
    """(in, N) of a fused matmul."""
    shapes = module_shapes(CONFIG)
    members = GROUPS[group]
    return shapes[members[0]][1], sum(shapes[m][0] for m in members)


def updated(rows: LoraRows, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out = out.clone()
    rows.add(layer, group, x, out)
    return out


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_c_update_equals_the_torch_per_row_update(kernel: LoraKernel, adapters: tuple[LoraAdapter, ...],
                                                      group: str) -> None:
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor(SLOTS)  # (T,)
    inp, N = widths(group)
    x = torch.randn(len(SLOTS), inp, generator=g)  # (T, in)
    out = torch.randn(len(SLOTS), N, generator=g)  # (T, N)
    for layer in range(CONFIG.num_layers):
        want = updated(LoraRows(slots, adapters), layer, group, x, out)
        got = updated(LoraRows(slots, adapters, kernel), layer, group, x, out)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[slots == -1], out[slots == -1])  # base rows untouched
        assert not torch.equal(got, out)  # an update happened, so the comparison could fail


@pytest.mark.parametrize("group", list(GROUPS))
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_threads(kernel: LoraKernel,
                                                               adapters: tuple[LoraAdapter, ...],
                                                               group: str) -> None:
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor(SLOTS)
    inp, N = widths(group)
    x, out = torch.randn(len(SLOTS), inp, generator=g), torch.randn(len(SLOTS), N, generator=g)
    threads = torch.get_num_threads()
    together = updated(LoraRows(slots, adapters, kernel), 1, group, x, out)
    try:
        torch.set_num_threads(1)
        one_thread = updated(LoraRows(slots, adapters, kernel), 1, group, x, out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)
    for t, s in enumerate(SLOTS):
        if s < 0:
            continue
        # alone, with its adapter in slot 0 of a one-adapter step
        alone = updated(LoraRows(torch.tensor([0]), adapters[s:s + 1], kernel), 1, group, x[t:t + 1],
                        out[t:t + 1])
        assert torch.equal(alone[0], together[t]), f"row {t}"
    # the rows in another order and another mix: every other row, reversed
    picked = torch.arange(len(SLOTS) - 1, -1, -2)  # (T',)
    other = updated(LoraRows(slots[picked], adapters, kernel), 1, group, x[picked], out[picked])
    assert torch.equal(other, together[picked])


def test_inputs_it_cannot_read_are_refused(kernel: LoraKernel, adapters: tuple[LoraAdapter, ...]) -> None:
    inp, N = widths("qkv")
    rows = LoraRows(torch.tensor([0, 1]), adapters, kernel)
    with pytest.raises(ValueError, match="does not fit"):
        rows.add(0, "qkv", torch.zeros(2, inp + 1), torch.zeros(2, N))
    with pytest.raises(ValueError, match="contiguous rows"):
        rows.add(0, "qkv", torch.zeros(inp, 2).T, torch.zeros(2, N))
    with pytest.raises(ValueError, match="differ in rows"):
        rows.add(0, "qkv", torch.zeros(3, inp), torch.zeros(2, N))
