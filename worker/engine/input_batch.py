"""vLLM v1's persistent input batch: a step's inputs in buffers that are allocated once.

`BatchBuilder` lists a step's tokens; `InputBatch.build` turns the lists into
the step's `ForwardBatch` without allocating: it writes host staging buffers (pinned on CUDA)
through numpy views, then issues one non-blocking copy per buffer into device buffers that never
move. Before, each step made ~8 tensors with `torch.tensor(list, device=cuda)`: on CUDA each a
pageable, blocking copy, so the host waited on the GPU 8 times a step.

Block tables are kept per request across steps (vLLM's BlockTable): a request's row is written
when it first runs and afterwards only the blocks it appended, so a step's table work is its new
blocks and one gather of its rows, not every sequence's whole table in Python (at 256 rows of
32k tokens that was ~500k list items a step). A table that changed otherwise (a speculative step's
reserved tail given back, a block swapped for its cached twin) has a new `version`
(kv_manager.py) and is written again whole. A request missing from a step loses its row.

The ForwardBatch's tensors are views of the buffers: valid until the next `build`. The engine
runs one step at a time and ends each with the sampled tokens' copy to the host, which waits for
the GPU; the next step writes the staging only after that, so no copy in flight reads a buffer
that is being rewritten. Buffers grow (doubling) when a step is larger than any before: in the
steady state nothing is allocated. On CPU the staging is the buffer and nothing is copied; the
model runner uses InputBatch on CUDA only (model_runner.py measured why).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.model.attention import ForwardBatch
from worker.model.lora import LoraAdapter

# The per-token int64 buffers: BatchBuilder's lists of the same names
TOKEN_FIELDS = ("ids", "positions", "slots", "logits_indices", "adapter_slots")


class BatchBuilder:
    """A step's flattened batch, one sequence (or decode row) at a time: its new tokens at
    positions start.., their cache slots through its block table, and which rows give logits."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.request_ids: list[str] = []  # per sequence (InputBatch keeps tables by request)
        self.versions: list[int] = []  # per sequence: its table's version (kv_manager.py)
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.tables: list[list[int]] = []
        self.context_lens: list[int] = []
        self.query_start = [0]
        self.logits_indices: list[int] = []
        self.adapter_slots: list[int] = []

    def add(self, table: list[int], token_ids: list[int], start: int, num_logits: int,
            adapter_slot: int = -1, request_id: str = "", version: int = 0) -> None:
        """Tokens at positions [start, start + len(token_ids)); logits for the last num_logits;
        adapter_slot: their LoRA adapter's index in the step's adapters (-1: the base model);
        request_id and version: the sequence and its table's version, for InputBatch."""
        self.request_ids.append(request_id)
        self.versions.append(version)
        bs, span = self.block_size, range(start, start + len(token_ids))
        self.ids.extend(token_ids)
        self.adapter_slots.extend([adapter_slot] * len(token_ids))
        self.positions.extend(span)
        self.slots.extend(table[p // bs] * bs + p % bs for p in span)
        self.tables.append(table)
        self.context_lens.append(span.stop)
        self.query_start.append(self.query_start[-1] + len(token_ids))
        self.logits_indices.extend(range(self.query_start[-1] - num_logits, self.query_start[-1]))

    def row_tables(self) -> list[list[int]]:
        """Each token's sequence's block table (a static step's rows, one per token)."""
        starts = self.query_start
        return [t for t, a, b in zip(self.tables, starts, starts[1:], strict=False) for _ in range(b - a)]

    def build(self, num_prefills: int, adapters: tuple[LoraAdapter, ...] = ()) -> ForwardBatch:
        """The first num_prefills sequences are prompt chunks, the rest decodes (1 + k tokens);
        `adapters`: the LoRA adapters the rows' adapter slots index. New tensors (InputBatch
        builds the same into its buffers)."""
        width = max(map(len, self.tables))
        padded = [t + [0] * (width - len(t)) for t in self.tables]

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        tables = torch.tensor(padded, dtype=torch.int32)  # (S, M) on the host
        return ForwardBatch(
            input_ids=tensor(self.ids), positions=tensor(self.positions),  # (T,), (T,)
            slot_mapping=tensor(self.slots),  # (T,)
            block_tables=tables.to(self.device),  # (S, M)
            context_lens=tensor(self.context_lens, torch.int32),  # (S,)
            query_start_loc=tuple(self.query_start), context_lens_host=tuple(self.context_lens),
            num_prefills=num_prefills, logits_indices=tensor(self.logits_indices),  # (R,)
            lora_slots=tensor(self.adapter_slots) if adapters else None, adapters=adapters,  # (T,)
            block_tables_host=tables,
        )


class _Buffer:
    """A device buffer and its host staging (pinned on CUDA; on CPU one tensor is both)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=self.pinned)
        self.device = self.host.to(device) if self.pinned else self.host
        self.staging = self.host.numpy()  # written through numpy: one C loop, no tensor per step
        # Views by shape, made once: a torch slice and view cost ~5 us, as much as the
        # torch.tensor(list) this replaces (batch 1 reuses one shape every step).
        self._views: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def stage(self, values: Sequence[int] | np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """The first prod(shape) values, copied to the device (non-blocking, from pinned memory):
        a view of the device buffer."""
        n = math.prod(shape)
        self.staging[:n].reshape(shape)[...] = values
        views = self._views.get(shape)
        if views is None:
            if len(self._views) >= 256:  # shapes seen once (prompt chunks of every length)
                self._views.clear()
            views = self._views[shape] = (self.device[:n].view(shape), self.host[:n].view(shape))
        if self.pinned:  # the host does not wait for the GPU
            views[0].copy_(views[1], non_blocking=True)
        return views[0]


class StagedRows:
    """Rows of `width` values in buffers allocated once (grown by doubling): the sampler's
    per-step parameters on CUDA, as the step's inputs above (pinned staging, one non-blocking
    copy; the views are valid until the next `stage`)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, rows: int = 16) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self.num_allocations = 0
        self._alloc(rows)

    def _alloc(self, rows: int) -> None:
        self.num_allocations += 1
        self._rows, self._buffer = rows, _Buffer(rows * self.width, self.dtype, self.device)

    def stage(self, values: Sequence[Sequence[float]] | Sequence[Sequence[int]]) -> torch.Tensor:
        """(B, width) on the device: a view of the buffer."""
        if len(values) > self._rows:
            self._alloc(_grown(self._rows, len(values)))
        if not values:
            return torch.zeros(0, self.width, dtype=self.dtype, device=self.device)
        return self._buffer.stage(np.asarray(values), (len(values), self.width))


@dataclass
class _Row:
    index: int  # its row in the persistent tables
    version: int  # of the table written there
    length: int  # blocks written


class InputBatch:
    def __init__(self, device: torch.device, *, num_tokens: int = 256, num_seqs: int = 16,
                 num_blocks: int = 64) -> None:
        """device: where the model runs; the sizes are starting capacities (they grow)."""
        self.device = device
        self._rows: dict[str, _Row] = {}
        self._tables = np.zeros((num_seqs, num_blocks), dtype=np.int32)  # persistent, (rows, M)
        self._free_rows = list(range(num_seqs))
        self.num_allocations = 0  # buffer (re)allocations: flat once the steps stop growing
        self._alloc_tokens(num_tokens)
        self._alloc_seqs(num_seqs, num_blocks)

    # -- buffers -----------------------------------------------------------------------------------

    def _alloc_tokens(self, n: int) -> None:
        self.num_allocations += 1
        self._token_cap = n
        self._token = {name: _Buffer(n, torch.int64, self.device) for name in TOKEN_FIELDS}  # (T,) each

    def _alloc_seqs(self, n: int, m: int) -> None:
        self.num_allocations += 1
        self._seq_cap, self._width_cap = n, m
        self._lens = _Buffer(n, torch.int32, self.device)  # (S,)
        self._step_tables = _Buffer(n * m, torch.int32, self.device)  # (S, M) of any M <= m: contiguous

    def _fit(self, num_tokens: int, num_seqs: int, width: int) -> None:
        if num_tokens > self._token_cap:
            self._alloc_tokens(_grown(self._token_cap, num_tokens))
        if num_seqs > self._seq_cap or width > self._width_cap:
            self._alloc_seqs(_grown(self._seq_cap, num_seqs), _grown(self._width_cap, width))
        if len(self._rows) + num_seqs > self._tables.shape[0] or width > self._tables.shape[1]:
            grown = np.zeros((_grown(self._tables.shape[0], len(self._rows) + num_seqs),
                              _grown(self._tables.shape[1], width)), dtype=np.int32)
            grown[:self._tables.shape[0], :self._tables.shape[1]] = self._tables
            self._free_rows += range(self._tables.shape[0], grown.shape[0])
            self._tables = grown

    # -- block tables --------------------------------------------------------------------------------

    def _sync_tables(self, step: BatchBuilder) -> list[int]:
        """Each sequence's row in the persistent tables, brought up to date; rows of requests not
        in this step are freed first."""
        present = set(step.request_ids)
        for gone in [r for r in self._rows if r not in present]:
            row = self._rows.pop(gone)
            self._tables[row.index] = 0
            self._free_rows.append(row.index)
        indices = []
        for rid, table, version in zip(step.request_ids, step.tables, step.versions, strict=True):
            known = self._rows.get(rid)
            if known is None:
                row = self._rows[rid] = _Row(self._free_rows.pop(), version, 0)
            else:
                row = known
            if row.version != version:  # changed other than by appending: write it whole
                self._tables[row.index] = 0
                row.version, row.length = version, 0
            if len(table) > row.length:  # the blocks appended since it was last written
                self._tables[row.index, row.length:len(table)] = table[row.length:]
                row.length = len(table)
            indices.append(row.index)
        return indices

    # -- the step ---------------------------------------------------------------------------------------

    def build(self, step: BatchBuilder, num_prefills: int,
              adapters: tuple[LoraAdapter, ...] = ()) -> ForwardBatch:
        """The step's ForwardBatch, its tensors views of the buffers (valid until the next build)."""
        n, s = len(step.ids), len(step.request_ids)
        width = max(map(len, step.tables))
        self._fit(n, s, width)
        rows = self._sync_tables(step)
        token = {name: buf.stage(getattr(step, name), (len(getattr(step, name)),))
                 for name, buf in self._token.items()}
        tables = self._tables[rows, :width]  # (S, M) on the host, 0-padded
        return ForwardBatch(
            input_ids=token["ids"], positions=token["positions"], slot_mapping=token["slots"],  # (T,) each
            block_tables=self._step_tables.stage(tables, (s, width)),  # (S, M)
            block_tables_host=torch.from_numpy(tables),
            context_lens=self._lens.stage(step.context_lens, (s,)),  # (S,)
            query_start_loc=tuple(step.query_start), context_lens_host=tuple(step.context_lens),
            num_prefills=num_prefills, logits_indices=token["logits_indices"],  # (R,)
            lora_slots=token["adapter_slots"] if adapters else None, adapters=adapters,  # (T,)
        )

    @property
    def num_rows(self) -> int:
        """Requests holding a row of the persistent tables."""
        return len(self._rows)


def _grown(capacity: int, needed: int) -> int:
    while capacity < needed:
        capacity *= 2
    return capacity
