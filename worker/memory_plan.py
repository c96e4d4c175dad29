"""How many KV blocks fit, planned by the worst step the scheduler can produce (vLLM's profile run).

On CUDA the warm-up runs that step before the pool is sized: max_num_seqs decode rows at
max_model_len (each row's table names the same blocks, so the warm-up cache is one sequence
long, yet every row reads a full-length context) plus a prompt chunk of the whole prefill
budget, and the sampler's rows with them. The caching allocator's peak over it is the
activation memory a real step may need on top of the weights, so the pool gets

    total x gpu_memory_utilization - (what was in use before the warm-up) - that peak

and a configuration that cannot hold one full-length sequence then is refused, naming what to
lower. (The previous warm-up ran one 512-token prefill: a batch of long decodes could need more
than the headroom it left, and fail in the middle of serving.) On CPU the pool is a share of
RAM (EngineConfig.kv_cache_memory_mb), taken page by page as it is written: nothing to plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.sampling import fused_exponential_race
from worker.model.attention import ForwardBatch
from worker.model.llama import LlamaModel


@dataclass(frozen=True)
class WorstStep:
    """The largest step: `num_decodes` rows at context `max_model_len`, plus `num_prefill_tokens`
    of one prompt chunk."""

    num_decodes: int
    max_model_len: int
    num_prefill_tokens: int
    block_size: int

    @property
    def cache_blocks(self) -> int:
        """Blocks of the warm-up cache: one full-length sequence (every decode row reads it) and
        the prompt chunk's own."""
        return -(-self.max_model_len // self.block_size) + -(-self.num_prefill_tokens // self.block_size)

    def batch(self, device: torch.device) -> ForwardBatch:
        """The step as the model runner would build it: the chunk first, then the decodes."""
        bs, n, L = self.block_size, self.num_prefill_tokens, self.max_model_len
        decode_blocks = -(-L // bs)
        chunk_table = list(range(decode_blocks, decode_blocks + -(-n // bs)))
        width = max(decode_blocks, len(chunk_table))
        tables = [chunk_table + [0] * (width - len(chunk_table))]
        tables += [list(range(decode_blocks)) + [0] * (width - decode_blocks)] * self.num_decodes
        positions = list(range(n)) + [L - 1] * self.num_decodes
        # every decode row writes the last slot of the shared sequence: a warm-up, nothing reads it
        slots = [chunk_table[p // bs] * bs + p % bs for p in range(n)] + [L - 1] * self.num_decodes
        starts = list(range(n, n + self.num_decodes + 1))
        lens = [n] + [L] * self.num_decodes

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return ForwardBatch(
            input_ids=tensor([0] * len(positions)), positions=tensor(positions),  # (T,)
            slot_mapping=tensor(slots), block_tables=tensor(tables, torch.int32),  # (T,), (S, M)
            context_lens=tensor(lens, torch.int32), query_start_loc=(0, *starts),
            context_lens_host=tuple(lens), num_prefills=1,
            logits_indices=tensor([n - 1] + starts[:-1]))  # (S,): the chunk's last token, each decode


def measure_peak_bytes(llama: LlamaModel, step: WorstStep) -> int:
    """CUDA: the allocator's peak above what was allocated before, over one forward of `step`
    and a sampler-sized softmax and race over its logits."""
    device = llama.device
    cache = llama.new_cache(step.cache_blocks, step.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = llama.forward(step.batch(device), cache)  # (R, V) float32
    probs = torch.softmax(logits, dim=-1)  # (R, V): the sampler's widest temporary
    rows = torch.arange(probs.shape[0], device=device)  # (R,) as seeds and steps
    # the sampler's fused race, compiled here rather than at the first sampled request (~30 s)
    fused_exponential_race()(probs, rows, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, logits
    return peak


@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int  # the device's memory
    used_bytes: int  # in use before the warm-up: weights, CUDA context, other processes
    peak_step_bytes: int  # the worst step's activations (measure_peak_bytes) and the sampler's state
    utilization: float  # the share of total_bytes this worker may use (--gpu-memory-utilization)


def kv_blocks(budget: MemoryBudget, block_bytes: int, blocks_per_seq: int, max_num_seqs: int) -> int:
    """KV blocks that fit beside the weights and the worst step, at most what max_num_seqs
    full-length sequences use. ValueError, naming what to lower, when not one sequence fits."""
    if not 0 < budget.utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {budget.utilization}")
    free = int(budget.total_bytes * budget.utilization) - budget.used_bytes - budget.peak_step_bytes
    num_blocks = max(free, 0) // block_bytes
    if num_blocks < blocks_per_seq:
        mb = 2**20
        raise ValueError(
            f"the KV cache does not fit: {budget.utilization:.0%} of {budget.total_bytes / mb:,.0f} MB, "
            f"less {budget.used_bytes / mb:,.0f} MB in use (weights, CUDA context) and "
            f"{budget.peak_step_bytes / mb:,.0f} MB for the worst step and the sampler's state, leaves "
            f"{max(free, 0) / mb:,.0f} MB: {num_blocks} blocks, and one sequence of max_model_len needs "
            f"{blocks_per_seq} ({blocks_per_seq * block_bytes / mb:,.0f} MB). "
            "Lower --max-num-seqs, --max-num-batched-tokens or --max-prefill-tokens (the worst step), "
            "or --max-model-len, "
            "or raise --gpu-memory-utilization")
    return min(num_blocks, max_num_seqs * blocks_per_seq)
