"""The attention backends (worker/model/attn_backends.py): cpu (the C kernels) and torch agree with
an exact reference on random block tables, lengths and head layouts, read nothing stale, and
FlashInfer's page metadata names exactly each row's K/V (checked here on CPU; its kernel needs
a GPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from worker.model.attention import KNBD, NKBD, ForwardBatch, KVCache
from worker.model.attn_backends import AttentionBackend, CpuBackend, TorchBackend
from worker.model.attn_choice import make_backend
from worker.model.config import ModelConfig
from worker.model.flashinfer_backend import paged_kv_metadata
from worker.model.native import NativeKernels, load_native_kernels

BLOCK = 4
NUM_BLOCKS = 64
# (H, K, D): GQA, MHA, MQA at head dims 64, 128 and 40
LAYOUTS = [(8, 2, 64), (4, 4, 128), (6, 1, 40)]


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    k = load_native_kernels()
    if k is None:
        pytest.skip("no C compiler here: the cpu backend cannot be built")
    return k


def make_config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(vocab_size=16, hidden_size=num_heads * head_dim, intermediate_size=8, num_layers=1,
                       num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


def make_step(rng: random.Random, news: list[int], contexts: list[int], num_prefills: int,
              ) -> tuple[ForwardBatch, list[list[int]]]:
    """Sequences with `news[s]` new tokens ending at `contexts[s]`, each with its own distinct
    random blocks (tables padded with block 0, as the batch builder pads)."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in contexts]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # (S, M)
    positions = [p for n, c in zip(news, contexts, strict=True) for p in range(c - n, c)]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK
             for n, c, t in zip(news, contexts, tables, strict=True) for p in range(c - n, c)]
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    batch = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), block_tables=padded,
        context_lens=torch.tensor(contexts, dtype=torch.int32), query_start_loc=tuple(starts),
        context_lens_host=tuple(contexts), num_prefills=num_prefills,
        logits_indices=torch.tensor([b - 1 for b in starts[1:]]))
    return batch, tables


def random_cache(config: ModelConfig, g: torch.Generator, layout: str = KNBD) -> KVCache:
    cache = KVCache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"), layout)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def context_kv(cache: KVCache, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's first n positions from its blocks, block by block: (K, n, D) each."""
    def rows(part: torch.Tensor) -> torch.Tensor:
        layer = part[0] if cache.layout == KNBD else part[0].transpose(0, 1)  # (K, N, Bs, D)
        return torch.cat([layer[:, b] for b in table], dim=1)[:, :n]
    return rows(cache.k), rows(cache.v)


def reference(q: torch.Tensor, cache: KVCache, table: list[int], context: int) -> torch.Tensor:
    """Causal attention of a sequence's n queries (n, H, D) at positions context - n .. context - 1
    over exactly its positions, in float64: (n, H, D)."""
    k, v = (t.double() for t in context_kv(cache, table, context))
    n, H, D = q.shape
    G = H // k.shape[0]
    k, v = k.repeat_interleave(G, dim=0), v.repeat_interleave(G, dim=0)  # (H, context, D)
    scores = torch.einsum("nhd,hcd->hnc", q.double(), k) * D ** -0.5  # (H, n, context)
    visible = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]  # (n, context)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnc,hcd->nhd", weights, v).float()


def run_step(backend: AttentionBackend, cache: KVCache, batch: ForwardBatch, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    plan = backend.plan(batch, cache)
    backend.write(cache, 0, k, v, plan)
    return backend.forward(0, q, k, v, cache, plan)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_cpu_and_torch_backends_agree_with_the_reference_on_mixed_steps(
        kernels: NativeKernels, num_heads: int, num_kv_heads: int, head_dim: int, seed: int) -> None:
    """A step of a whole prompt, a continued chunk (prefix hit) and decode rows of random lengths."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    config = make_config(num_heads, num_kv_heads, head_dim)
    news = [rng.randint(2, 9), rng.randint(2, 6), 1, 1, 1]
    contexts = [news[0], news[1] + rng.randint(1, 12), rng.randint(1, 30), rng.randint(1, 30), 1]
    batch, tables = make_step(rng, news, contexts, num_prefills=2)
    T = sum(news)
    q = torch.randn(T, num_heads, head_dim, generator=g)
    k, v = (torch.randn(T, num_kv_heads, head_dim, generator=g) for _ in range(2))
    base = random_cache(config, g)
    outs = {}
    for backend in (CpuBackend(kernels), TorchBackend()):
        cache = random_cache(config, torch.Generator().manual_seed(99))
        cache.k.copy_(base.k)
        cache.v.copy_(base.v)
        outs[backend.name] = run_step(backend, cache, batch, q, k, v)
    starts = batch.query_start_loc
    want = torch.cat([reference(q[a:b], cache, tables[s], contexts[s])
                      for s, (a, b) in enumerate(zip(starts, starts[1:], strict=False))])
    for name, got in outs.items():
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend_name", ["cpu", "torch"])
def test_a_poisoned_padding_block_or_stale_slot_changes_no_rows_output(kernels: NativeKernels,
                                                                       backend_name: str) -> None:
    g = torch.Generator().manual_seed(0)
    config = make_config(4, 2, 8)
    backend = CpuBackend(kernels) if backend_name == "cpu" else TorchBackend()
    batch, tables = make_step(random.Random(3), [3, 1, 1, 1], [7, 6, 3, 5], num_prefills=1)
    clean = random_cache(config, g)
    q = torch.randn(6, 4, 8, generator=g)
    k, v = (torch.randn(6, 2, 8, generator=g) for _ in range(2))
    want = run_step(backend, clean, batch, q, k, v)
    used = {(b, p % BLOCK) for t, c in zip(tables, [7, 6, 3, 5], strict=True)
            for p, b in ((p, t[p // BLOCK]) for p in range(c))}
    for poison in (float("nan"), float("inf"), float("-inf")):
        poisoned = random_cache(config, g)
        poisoned.k.copy_(clean.k)
        poisoned.v.copy_(clean.v)
        for block in range(NUM_BLOCKS):  # the padding block 0 and every slot no row owns
            for offset in range(BLOCK):
                if (block, offset) not in used:
                    poisoned.k[0, :, block, offset] = poison
                    poisoned.v[0, :, block, offset] = poison
        got = run_step(backend, poisoned, batch, q, k, v)
        assert torch.isfinite(got).all(), f"{poison} leaked into a row"
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_torch_backend_reads_a_block_major_cache_as_it_reads_its_own() -> None:
    g = torch.Generator().manual_seed(5)
    config = make_config(8, 2, 64)
    batch, _ = make_step(random.Random(5), [5, 1, 1], [9, 13, 2], num_prefills=1)
    knbd = random_cache(config, g)
    nkbd = KVCache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"), NKBD)
    nkbd.k.copy_(knbd.k.transpose(1, 2))
    nkbd.v.copy_(knbd.v.transpose(1, 2))
    q = torch.randn(7, 8, 64, generator=g)
    k, v = (torch.randn(7, 2, 64, generator=g) for _ in range(2))
    want = run_step(TorchBackend(), knbd, batch, q, k, v)
    got = run_step(TorchBackend(), nkbd, batch, q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(nkbd.k.transpose(1, 2), knbd.k, rtol=0, atol=0)  # the same slots written


def test_flashinfer_page_metadata_names_exactly_each_rows_kv() -> None:
    """Rebuild each sequence's contiguous K/V from (indptr, indices, last_page_len) over a
    block-major cache, as FlashInfer reads it, and compare with its blocks read directly."""
    rng, g = random.Random(11), torch.Generator().manual_seed(11)
    config = make_config(4, 2, 16)
    contexts = [rng.randint(1, 20) for _ in range(7)] + [BLOCK, 2 * BLOCK, 1]  # full last pages too
    news = [min(c, rng.randint(1, 3)) for c in contexts]
    batch, tables = make_step(rng, news, contexts, num_prefills=0)
    cache = random_cache(config, g, NKBD)
    meta = paged_kv_metadata(batch, BLOCK)
    assert meta.qo_indptr.tolist() == list(batch.query_start_loc)
    assert meta.indptr.dtype == meta.indices.dtype == meta.last_page_len.dtype == torch.int32
    assert 0 not in meta.indices.tolist()  # the tables' padding is never named
    for s, context in enumerate(contexts):
        pages = meta.indices[meta.indptr[s]:meta.indptr[s + 1]].tolist()
        last = int(meta.last_page_len[s])
        assert 1 <= last <= BLOCK and pages == tables[s]
        # (K, context, D): the full pages, then the used part of the last
        k = torch.cat([cache.k[0, p] for p in pages[:-1]] + [cache.k[0, pages[-1], :, :last]], dim=1)
        v = torch.cat([cache.v[0, p] for p in pages[:-1]] + [cache.v[0, pages[-1], :, :last]], dim=1)
        want_k, want_v = context_kv(cache, tables[s], context)
        assert k.shape[1] == context
        torch.testing.assert_close(k, want_k, rtol=0, atol=0)
        torch.testing.assert_close(v, want_v, rtol=0, atol=0)


def test_flashinfer_page_metadata_reads_the_hosts_tables_when_the_step_has_them() -> None:
    """The device's tables are not read back (that would wait for the GPU every step)."""
    batch, _ = make_step(random.Random(3), [1, 2, 1], [5, 9, 14], num_prefills=0)
    want = paged_kv_metadata(batch, BLOCK)
    garbage = torch.full_like(batch.block_tables, 7)
    on_host = dataclasses.replace(batch, block_tables=garbage, block_tables_host=batch.block_tables)
    got = paged_kv_metadata(on_host, BLOCK)
    for name in ("qo_indptr", "indptr", "indices", "last_page_len"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_backends_are_chosen_by_name_or_by_what_runs_here(kernels: NativeKernels) -> None:
    cpu = torch.device("cpu")
    assert make_backend("auto", kernels, cpu, 4, torch.float32).name == "cpu"
    assert make_backend("auto", None, cpu, 4, torch.float32).name == "torch"
    assert make_backend("torch", kernels, cpu, 4, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="needs the C kernels"):
        make_backend("cpu", None, cpu, 4, torch.float32)
    with pytest.raises(ValueError, match="runs on CUDA"):
        make_backend("flashinfer", None, cpu, 4, torch.float32)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        make_backend("paged", None, cpu, 4, torch.float32)
