"""Decode steps through buffers allocated once: the step CUDA graphs capture (gpt-fast's static
buffers, vLLM's decode buckets).

A decode-only step of B rows is padded to the smallest bucket >= B (1, 2, 4, 8, ... up to the
most rows a step can have) and runs on views of buffers that never move: token ids, positions,
slots, block tables and lengths. On CUDA each bucket's forward is captured once at start-up
and replayed; the values of a step are copied into the buffers first, from pinned host
staging with one non-blocking copy each. The same buffers run eagerly anywhere (capture off),
which is how the CPU tests check that a padded static step gives exactly what the dynamic
step gives, for every bucket.

Padding rows decode one token at position 0 through a scratch block: the cache's last block,
which the engine keeps out of its pool, so a padding row's K/V never lands in a request's
blocks. The attention backends read only device tensors for a static batch
(`ForwardBatch.is_static`); what a backend must do on the host first (FlashInfer's plan into
its fixed buffers) it does in `plan_static`, called before every run or replay and before each
capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.model.attention import ForwardBatch, KVCache
from worker.model.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """The padded row counts a static step runs at: the powers of 2 below max_rows, and max_rows."""
    return (*(b for b in BUCKETS if b < max_rows), max_rows)


class StaticDecode:
    def __init__(self, model: LlamaModel, cache: KVCache, max_rows: int, max_blocks: int, *,
                 capture: bool) -> None:
        """max_rows: the most decode rows a step has (max_num_seqs x (1 + proposals));
        max_blocks: a block table's width (blocks of max_model_len). The cache's last block is
        the scratch block. capture: record a CUDA graph per bucket now."""
        if model.is_lora_enabled:
            raise ValueError("static decode steps do not carry LoRA adapters")
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model, self.cache = model, cache
        self.buckets = decode_buckets(max_rows)
        self.scratch = cache.num_blocks - 1
        self.max_blocks = max_blocks
        dev, pin = model.device, model.device.type == "cuda"

        def buffers(shape: tuple[int, ...], dtype: torch.dtype, fill: int) -> tuple[torch.Tensor, ...]:
            """(device buffer, host staging): on CPU one tensor is both."""
            host = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
            return (host.to(dev) if pin else host), host

        bs = cache.block_size
        self.ids, self._ids = buffers((max_rows,), torch.int64, 0)  # (Bmax,)
        self.positions, self._positions = buffers((max_rows,), torch.int64, 0)
        self.slots, self._slots = buffers((max_rows,), torch.int64, self.scratch * bs)
        self.tables, self._tables = buffers((max_rows, max_blocks), torch.int32, self.scratch)  # (Bmax, M)
        self.lens, self._lens = buffers((max_rows,), torch.int32, 1)
        self.logits_indices = torch.arange(max_rows, device=dev)
        self._pairs = [(self.ids, self._ids), (self.positions, self._positions), (self.slots, self._slots),
                       (self.tables, self._tables), (self.lens, self._lens)]
        self.num_steps = 0  # static steps run (replayed or eager)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def batch(self, rows: int) -> ForwardBatch:
        """The buffers' first `rows` rows as a static step."""
        return ForwardBatch(
            input_ids=self.ids[:rows], positions=self.positions[:rows], slot_mapping=self.slots[:rows],
            block_tables=self.tables[:rows], context_lens=self.lens[:rows],
            query_start_loc=tuple(range(rows + 1)), context_lens_host=(1,) * rows, num_prefills=0,
            logits_indices=self.logits_indices[:rows], is_static=True)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits (B, V) of one decode-only step of B rows, one per token (a verify's 1 + k tokens
        are k + 1 rows, each of length its position + 1): the batch builder's lists, `tables` per
        row. Every row's logits are returned."""
        n = len(ids)
        lens = [p + 1 for p in positions]
        b = self.bucket(n)
        self.num_steps += 1
        h_ids, h_positions, h_slots, h_tables, h_lens = (host.numpy() for _, host in self._pairs)
        h_ids[:n], h_positions[:n], h_slots[:n], h_lens[:n] = ids, positions, slots, lens
        h_ids[n:b], h_positions[n:b], h_lens[n:b] = 0, 0, 1  # padding rows: position 0, length 1,
        h_slots[n:b] = self.scratch * self.cache.block_size  # in the scratch block
        h_tables[:b] = self.scratch
        for row, table in enumerate(tables):
            h_tables[row, :len(table)] = table
        if self.model.device.type == "cuda":  # one non-blocking copy per buffer, from pinned memory
            for dev, host in self._pairs:
                dev[:b].copy_(host[:b], non_blocking=True)
        self.model.attention.plan_static(self._tables[:b], self._lens[:b], self.cache)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            return self._outputs[b][:n]
        return self.model.forward(self.batch(b), self.cache)[:n]

    def _capture_all(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (as vLLM captures)."""
        pool = None
        for b in sorted(self.buckets, reverse=True):
            batch = self.batch(b)
            self.model.attention.plan_static(self._tables[:b], self._lens[:b], self.cache)  # the padding's
            side = torch.cuda.Stream(self.model.device)
            side.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(side):  # the warm-up runs outside the capture, as torch requires
                self.model.forward(batch, self.cache)
            torch.cuda.current_stream(self.model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b] = self.model.forward(batch, self.cache)
            pool = graph.pool()
            self.graphs[b] = graph

