"""A stand-in for flashinfer-python's two paged-attention wrappers, in torch on the CPU.

It takes the calls worker/model/flashinfer_backend.py makes, with the semantics FlashInfer
documents: an HND cache (N, K, Bs, D) per layer, a sequence's pages as CSR metadata (indptr,
indices, last_page_len), its queries aligned with the last positions of its context (causal),
and in CUDA-graph mode metadata buffers fixed at construction that `plan` fills and `run`
reads. So the backend's plumbing (metadata, one wrapper per static bucket, a plan before every
static step) runs in tests without a GPU. What FlashInfer's kernels compute is not tested here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], qo_indptr: list[int],
           indptr: list[int], indices: list[int], last_page_len: list[int]) -> torch.Tensor:
    """q (T, H, D): each sequence's rows over its pages, causally -> (T, H, D)."""
    k_cache, v_cache = cache  # (N, K, Bs, D) each
    _, num_kv_heads, bs, head_dim = k_cache.shape
    outs = []
    for s in range(len(indptr) - 1):
        pages = torch.tensor(indices[indptr[s]:indptr[s + 1]])
        context = (len(pages) - 1) * bs + last_page_len[s]
        k, v = (c[pages].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[None, :, :context].to(q.dtype)
                for c in (k_cache, v_cache))  # (1, K, context, D)
        qs = q[None, qo_indptr[s]:qo_indptr[s + 1]].transpose(1, 2)  # (1, H, n, D)
        n = qs.shape[2]
        query_pos = torch.arange(context - n, context)[:, None]  # (n, 1)
        mask = torch.arange(context)[None, :] <= query_pos  # (n, context)
        out = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))  # (n, H, D)
    return torch.cat(outs)


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "HND"
        self.meta: tuple[list[int], ...] = ()

    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, causal: bool, q_data_type: torch.dtype, kv_data_type: torch.dtype) -> None:
        assert causal
        self.meta = tuple(t.tolist() for t in (qo_indptr, indptr, indices, last_page_len))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return attend(q, paged_kv_cache, *self.meta)


class BatchDecodeWithPagedKVCacheWrapper:
    """Only the CUDA-graph mode, the one the backend uses: buffers given at construction."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str, *, use_cuda_graph: bool,
                 use_tensor_cores: bool, paged_kv_indptr_buffer: torch.Tensor,
                 paged_kv_indices_buffer: torch.Tensor, paged_kv_last_page_len_buffer: torch.Tensor) -> None:
        assert kv_layout == "HND" and use_cuda_graph
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_page_len = paged_kv_last_page_len_buffer
        self.num_plans = 0

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, **kw: Any) -> None:
        # in graph mode the batch size is the buffers' (FlashInfer refuses another)
        assert indptr.shape == self.indptr.shape and last_page_len.shape == self.last_page_len.shape
        assert indices.shape[0] <= self.indices.shape[0]
        self.indptr.copy_(indptr)
        self.indices[:indices.shape[0]].copy_(indices)
        self.last_page_len.copy_(last_page_len)
        self.num_plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """What a replay reads: the buffers as the last plan left them, one query per row."""
        rows = q.shape[0]
        assert rows == self.last_page_len.shape[0]
        return attend(q, paged_kv_cache, list(range(rows + 1)), self.indptr.tolist(), self.indices.tolist(),
                      self.last_page_len.tolist())
