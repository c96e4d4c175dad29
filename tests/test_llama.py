"""Logits parity of worker/model/llama.py with transformers' LlamaForCausalLM, over a paged cache."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.factories import make_hf_model, ours_from_hf  # noqa: E402
from worker.model.llama import ForwardBatch, KVCache, LlamaModel  # noqa: E402
from worker.model.native import COMPILERS  # noqa: E402

TOL = 1e-4
BLOCK_SIZE = 4
HAS_COMPILER = any(shutil.which(c) for c in COMPILERS)  # else CPU decode falls back to torch


@dataclass
class PagedSeqs:
    """Block tables handed out from a shuffled pool, so no sequence's blocks are contiguous."""

    model: LlamaModel
    num_blocks: int = 64
    kv_dtype: torch.dtype | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dtype = self.kv_dtype or self.model.dtype
        self.cache = KVCache(self.model.config, self.num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"))
        self.free = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(7)).tolist()

    def step(self, prefills: list[tuple[str, int, list[int]]], decodes: list[tuple[str, int, int]] = ()
             ) -> torch.Tensor:  # type: ignore[assignment]
        """prefills: (name, start position, tokens); decodes: (name, position, token). Returns the
        logits of each prefill's last token, then of each decode: (len(prefills) + len(decodes), V)."""
        parts = [*prefills, *((name, pos, [tok]) for name, pos, tok in decodes)]
        ids, positions, slots, tables, lens, starts = [], [], [], [], [], [0]
        for name, start, tokens in parts:
            table = self.tables.setdefault(name, [])
            end = start + len(tokens)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            tables.append(table)
            lens.append(end)
            starts.append(starts[-1] + len(tokens))
        width = max(map(len, tables))
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=tuple(starts),
            context_lens_host=tuple(lens), num_prefills=len(prefills),
            logits_indices=torch.tensor([s - 1 for s in starts[1:]]))
        return self.model.forward(batch, self.cache)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # (T, V)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = {
    "gqa_untied": dict(num_heads=4, num_kv_heads=2),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie=True),
    "mqa": dict(num_heads=4, num_kv_heads=1),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "linear_rope_bias": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True),
}


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_every_decode_step_match_transformers(case: str, native: bool) -> None:
    hf = make_hf_model(**CASES[case])  # type: ignore[arg-type]
    ours = ours_from_hf(hf, native=native)
    assert (ours.kernels is not None) == (native and HAS_COMPILER)
    seqs = PagedSeqs(ours)
    ids = random_ids(40, seed=1)
    prompt, rest = ids[:24], ids[24:]
    ref = hf_logits(hf, ids)
    got = seqs.step([("a", 0, prompt)])[0]
    assert (got - ref[len(prompt) - 1]).abs().max() <= TOL
    for j, tok in enumerate(rest[:-1]):  # positions 24..38: across block boundaries (block size 4)
        pos = len(prompt) + j
        assert (seqs.step([], [("a", pos, tok)])[0] - ref[pos]).abs().max() <= TOL, f"decode step {j}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_path_tracks_transformers_fp32(dtype: torch.dtype) -> None:
    """What CUDA runs (F.linear on plain weights, a half-precision KV cache), checked on CPU."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2)
    ours = ours_from_hf(hf, dtype=dtype)
    assert ours.layers[0].wqkv.dtype == dtype and ours.layers[0].wqkv.layout == torch.strided  # not packed
    assert ours.kernels is None
    seqs = PagedSeqs(ours)
    ids = random_ids(32, seed=2)
    ref = hf_logits(hf, ids)  # fp32
    scale = ref.abs().max().item()
    got = seqs.step([("a", 0, ids[:24])])[0]
    assert got.dtype == torch.float32
    assert (got - ref[23]).abs().max() <= 0.01 * scale
    for pos in range(24, 31):
        assert (seqs.step([], [("a", pos, ids[pos])])[0] - ref[pos]).abs().max() <= 0.01 * scale, pos


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_kv_cache_under_an_fp32_model(kv_dtype: torch.dtype, native: bool) -> None:
    """--kv-cache-dtype on CPU: fp32 maths, K/V stored in half precision (read by the C kernel)."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2)
    ours = ours_from_hf(hf, native=native)
    seqs = PagedSeqs(ours, kv_dtype=kv_dtype)
    assert seqs.cache.k.dtype == kv_dtype
    ids = random_ids(32, seed=3)
    ref = hf_logits(hf, ids)
    scale = ref.abs().max().item()
    assert (seqs.step([("a", 0, ids[:20])])[0] - ref[19]).abs().max() <= 0.02 * scale
    assert (seqs.step([("a", 20, ids[20:28])])[0] - ref[27]).abs().max() <= 0.02 * scale  # prefix from blocks
    for pos in range(28, 31):
        assert (seqs.step([], [("a", pos, ids[pos])])[0] - ref[pos]).abs().max() <= 0.02 * scale, pos


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_packed_prefill_of_several_prompts_matches_each_alone(native: bool) -> None:
    hf = make_hf_model()
    seqs = PagedSeqs(ours_from_hf(hf, native=native))
    prompts = [random_ids(n, seed=5 + n) for n in (6, 1, 13, 8)]  # 8: ends exactly on a block boundary
    got = seqs.step([(f"p{i}", 0, p) for i, p in enumerate(prompts)])  # (4, V)
    for p, row in zip(prompts, got, strict=True):
        assert (row - hf_logits(hf, p)[-1]).abs().max() <= TOL
    # each prompt's K/V are in its own blocks: a decode step continues every one correctly
    nxt = [int(r.argmax()) for r in got]
    decodes = [(f"p{i}", len(p), tok) for i, (p, tok) in enumerate(zip(prompts, nxt, strict=True))]
    step = seqs.step([], decodes)
    for p, tok, row in zip(prompts, nxt, step, strict=True):
        assert (row - hf_logits(hf, p + [tok])[-1]).abs().max() <= TOL


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_mixed_step_of_fresh_prompts_chunks_and_decodes_matches_transformers(native: bool) -> None:
    """One forward: a fresh prompt, the second chunk of another (its prefix read from blocks),
    then one decode token for each of two running sequences; every logit row equals transformers'."""
    hf = make_hf_model(num_heads=4, num_kv_heads=2)
    seqs = PagedSeqs(ours_from_hf(hf, native=native))
    running = [random_ids(n, seed=n) for n in (7, 19)]
    fresh, chunked = random_ids(5, seed=50), random_ids(16, seed=51)
    seqs.step([("r0", 0, running[0][:-1]), ("r1", 0, running[1][:-1]), ("chunked", 0, chunked[:9])])
    decodes = [(f"r{i}", len(r) - 1, r[-1]) for i, r in enumerate(running)]
    got = seqs.step([("fresh", 0, fresh), ("chunked", 9, chunked[9:])], decodes)
    assert got.shape[0] == 4
    for row, ids in zip(got, [fresh, chunked, *running], strict=True):
        assert (row - hf_logits(hf, ids)[-1]).abs().max() <= TOL


def test_shared_prefix_blocks_serve_two_sequences() -> None:
    """Two sequences whose tables start with the same physical blocks (a prefix hit) each
    continue correctly from them."""
    hf = make_hf_model()
    seqs = PagedSeqs(ours_from_hf(hf))
    prefix = random_ids(12, seed=60)  # three full blocks
    seqs.step([("a", 0, prefix + [5, 6])])
    seqs.tables["b"] = seqs.tables["a"][:3]  # b shares a's prefix blocks
    tails = {"a": [5, 6, 7], "b": [9, 10, 11, 12, 13]}
    got = seqs.step([("b", 12, tails["b"])], [("a", 14, 7)])
    assert (got[0] - hf_logits(hf, prefix + tails["b"])[-1]).abs().max() <= TOL
    assert (got[1] - hf_logits(hf, prefix + tails["a"])[-1]).abs().max() <= TOL


def _resident_kb(t: torch.Tensor) -> int:
    """Resident KB of the mapping holding t's memory (Linux /proc/self/smaps)."""
    address, lines = t.data_ptr(), open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        start, _, rest = line.partition("-")
        if rest and all(c in "0123456789abcdef" for c in start):
            end = int(rest.split()[0], 16)
            if int(start, 16) <= address < end:
                return next(int(ln.split()[1]) for ln in lines[i + 1:] if ln.startswith("Rss:"))
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_cpu_kv_cache_takes_memory_block_by_block() -> None:
    """Writing one block per (layer, kv head) makes ~4 KB resident each, not a 2 MB huge page."""
    config = ours_from_hf(make_hf_model()).config  # 2 layers, 2 kv heads, head dim 16
    cache = KVCache(config, num_blocks=4096, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    before = _resident_kb(cache.k)
    cache.k[:, :, 0] = 1.0  # block 0 of every (layer, kv head): 4 regions of 4 MB each
    assert _resident_kb(cache.k) - before <= 4 * 8  # 4 KB pages (a huge page each would be 8 MB)
    assert float(cache.k.sum()) == 4 * 16 * 16 and float(cache.v.abs().sum()) == 0.0
