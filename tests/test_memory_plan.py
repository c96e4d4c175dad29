"""The KV pool's plan by the worst step (worker/memory_plan.py): its arithmetic, its refusal, and
the worst step itself as a batch the model runs (on CPU here; the peak is measured on CUDA only)."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_hf_model, ours_from_hf
from worker.engine.config import EngineConfig
from worker.memory_plan import MemoryBudget, WorstStep, kv_blocks

GIB, MIB = 2**30, 2**20


def test_the_pool_gets_what_utilization_leaves_beside_the_weights_and_the_worst_step() -> None:
    budget = MemoryBudget(total_bytes=80 * GIB, used_bytes=16 * GIB, peak_step_bytes=4 * GIB, utilization=0.9)
    # 72 GiB allowed - 16 in use - 4 for the step = 52 GiB of 2 MiB blocks
    assert kv_blocks(budget, 2 * MIB, blocks_per_seq=128, max_num_seqs=1024) == 52 * 512
    # never more than max_num_seqs full-length sequences use
    assert kv_blocks(budget, 2 * MIB, blocks_per_seq=128, max_num_seqs=8) == 8 * 128


def test_a_configuration_that_cannot_hold_one_sequence_is_refused_naming_what_to_lower() -> None:
    budget = MemoryBudget(total_bytes=80 * GIB, used_bytes=70 * GIB, peak_step_bytes=2 * GIB, utilization=0.9)
    with pytest.raises(ValueError) as refused:
        kv_blocks(budget, 2 * MIB, blocks_per_seq=2048, max_num_seqs=256)  # 4 GiB per sequence, 0 left
    message = str(refused.value)
    for what in ("--max-num-seqs", "--max-num-batched-tokens", "--max-prefill-tokens", "--max-model-len",
                 "--gpu-memory-utilization",
                 "2,048 MB for the worst step", "needs 2048"):
        assert what in message
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks(MemoryBudget(GIB, 0, 0, 1.5), MIB, 1, 1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)


@pytest.mark.parametrize("native", [True, False], ids=["cpu-backend", "torch-backend"])
def test_the_worst_step_is_a_batch_the_model_runs(native: bool) -> None:
    """max_num_seqs decode rows, each over a full max_model_len context, plus the prefill budget:
    every row reads a full-length context from a cache one sequence long."""
    model = ours_from_hf(make_hf_model(max_position_embeddings=64), native=native)
    step = WorstStep(num_decodes=6, max_model_len=64, num_prefill_tokens=20, block_size=16)
    assert step.cache_blocks == 4 + 2
    batch = step.batch(torch.device("cpu"))
    assert batch.context_lens_host == (20,) + (64,) * 6 and batch.num_prefills == 1
    assert batch.query_start_loc == (0, 20, 21, 22, 23, 24, 25, 26)
    assert batch.logits_indices.tolist() == [19, 20, 21, 22, 23, 24, 25]
    cache = model.new_cache(step.cache_blocks, step.block_size)
    assert int(batch.slot_mapping.max()) < step.cache_blocks * step.block_size
    logits = model.forward(batch, cache)
    assert logits.shape == (7, model.config.vocab_size) and torch.isfinite(logits).all()
