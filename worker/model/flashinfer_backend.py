"""The `flashinfer` attention backend: FlashInfer's batch prefill kernel over the paged cache.

FlashInfer (flashinfer-python, the kernel library vLLM, SGLang and TensorRT-LLM use for paged
attention) reads a block-major cache, its HND layout: each layer's K and V (N, K, Bs, D), a
page = one block. A step's pages are given in CSR form (`PagedKVMetadata`): sequence s reads
pages indices[indptr[s]:indptr[s + 1]], the last of them filled to last_page_len[s]; its
queries are rows qo_indptr[s]:qo_indptr[s + 1]. One causal prefill call covers prompt chunks,
decode rows and speculative verifies: FlashInfer aligns a sequence's n queries with the last
n of its kv positions, which is what every row here is.

The metadata is built from the block tables once per step (`paged_kv_metadata`, plain torch:
tested on CPU by rebuilding each row's K/V from it) and planned once per step; every layer
then runs the same plan. It is built on the host and copied, as vLLM does.

Static decode steps (static_decode.py, the steps CUDA graphs replay) run FlashInfer's decode
kernel in its CUDA-graph mode, as vLLM does: one `BatchDecodeWithPagedKVCacheWrapper` per
bucket of rows, made with `use_cuda_graph=True` over metadata buffers that never move (the
bucket's indptr and last-page lengths, room for every row's whole table in indices). Before a
static step runs or replays, `plan_static` plans the bucket's wrapper from the step's host
tables (host work and copies into those buffers, outside the graph); the graph holds only the
kernels. A graph captured with the padding rows' plan then reads each replay's pages.

The cpu tests cover the metadata, and run this backend's calls against a stand-in of
FlashInfer's two wrappers written in torch (tests/fake_flashinfer.py): what FlashInfer itself
does with them needs a CUDA device and flashinfer-python (`pip install tokenrelay[cuda]`),
and has NOT run on a GPU yet.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from worker.model.attention import NKBD, ForwardBatch, KVCache
from worker.model.attn_backends import AttentionBackend, StepPlan, write_index

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's scratch for split-KV partial results (its docs' size)


def is_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@dataclass
class PagedKVMetadata:
    """One step's pages in FlashInfer's CSR form; all int32, on the host."""

    qo_indptr: torch.Tensor  # (S + 1,) each sequence's query rows
    indptr: torch.Tensor  # (S + 1,) each sequence's pages in `indices`
    indices: torch.Tensor  # (sum of pages,) block ids, sequence by sequence, in position order
    last_page_len: torch.Tensor  # (S,) 1 .. Bs: positions used in each sequence's last page


def paged_kv_metadata(batch: ForwardBatch, block_size: int) -> PagedKVMetadata:
    """The step's pages: each sequence's first ceil(context / Bs) blocks of its block table, so
    the padding in the table (block 0) and blocks past a row's end are never named."""
    context = torch.tensor(batch.context_lens_host, dtype=torch.int32)  # (S,)
    # the host's copy of the tables where the step has one: reading the device's back waits for the GPU
    tables = batch.block_tables_host if batch.block_tables_host is not None else batch.block_tables.cpu()
    indptr, indices, last_page_len = pages_csr(tables, context, block_size)
    qo_indptr = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    return PagedKVMetadata(qo_indptr, indptr, indices, last_page_len)


def pages_csr(tables: torch.Tensor, context: torch.Tensor, block_size: int,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr (S + 1,), indices, last_page_len (S,)), int32 on the host, of sequences with block
    tables (S, M) and context lengths (S,), all on the host."""
    context = context.to(torch.int32)
    pages = (context + block_size - 1) // block_size  # (S,)
    used = torch.arange(tables.shape[1], dtype=torch.int32)[None, :] < pages[:, None]  # (S, M)
    zero = torch.zeros(1, dtype=torch.int32)
    return (torch.cat([zero, torch.cumsum(pages, 0, dtype=torch.int32)]),
            tables.to(torch.int32)[used],  # row-major: sequence by sequence, each in position order
            context - (pages - 1) * block_size)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    cache_layout = NKBD

    def __init__(self, device: torch.device, num_heads: int, dtype: torch.dtype) -> None:
        require_cuda(device)
        if not is_available():
            raise ValueError("the flashinfer attention backend needs flashinfer-python "
                             "(pip install 'tokenrelay[cuda]'); or use --attention-backend torch")
        import flashinfer

        self._flashinfer: Any = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
        self._static: dict[int, Any] = {}  # rows -> the bucket's CUDA-graph decode wrapper
        self.device, self._num_heads, self._q_dtype = device, num_heads, dtype

    def plan(self, batch: ForwardBatch, cache: KVCache, *, all_rows_as_decodes: bool = False) -> StepPlan:
        """extra: the wrapper the layers run, planned (a static step's: by plan_static)."""
        if batch.is_static:  # no host work here: this runs inside a CUDA-graph capture
            wrapper = self._static.get(batch.input_ids.shape[0])
            if wrapper is None:
                raise RuntimeError("a static step's FlashInfer plan comes first (StaticDecode.run plans it)")
            return StepPlan(batch, write_index(batch, cache), wrapper)
        meta = paged_kv_metadata(batch, cache.block_size)
        _, num_kv_heads, bs, head_dim = cache.k.shape[1:]
        self._wrapper.plan(meta.qo_indptr.to(self.device), meta.indptr.to(self.device),
                           meta.indices.to(self.device), meta.last_page_len.to(self.device),
                           self._num_heads, num_kv_heads, head_dim, bs, causal=True,
                           q_data_type=self._q_dtype, kv_data_type=cache.dtype)
        return StepPlan(batch, write_index(batch, cache), self._wrapper)

    def plan_static(self, tables: torch.Tensor, lens: torch.Tensor, cache: KVCache) -> None:
        """Plan the decode wrapper of a static step of B rows (one query each) from its host
        tables (B, M) and context lengths (B,): before the step runs or its graph replays."""
        rows, width = tables.shape
        _, num_kv_heads, bs, head_dim = cache.k.shape[1:]
        wrapper = self._static.get(rows)
        if wrapper is None:  # buffers that never move: the graph reads them at every replay
            wrapper = self._static[rows] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_cuda_graph=True,
                use_tensor_cores=self._num_heads // num_kv_heads >= 4,  # vLLM's choice for GQA
                paged_kv_indptr_buffer=torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(rows * width, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(rows, dtype=torch.int32, device=self.device))
        indptr, indices, last_page_len = pages_csr(tables, lens, bs)
        wrapper.plan(indptr.to(self.device), indices.to(self.device), last_page_len.to(self.device),
                     self._num_heads, num_kv_heads, head_dim, bs, q_data_type=self._q_dtype,
                     kv_data_type=cache.dtype)

    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                plan: StepPlan) -> torch.Tensor:
        return plan.extra.run(q.contiguous(), (cache.k[i], cache.v[i]))  # (T, H, D)


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"the flashinfer attention backend runs on CUDA, not {device}")
