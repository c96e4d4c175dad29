"""The persistent input batch (worker/engine/input_batch.py): the same ForwardBatch as the list
builder's fresh tensors, step after step, from buffers that stop being allocated."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from protos.params import SamplingParams
from tests.factories import greedy, make_engine, make_hf_model, make_prompts, ours_from_hf, run_to_completion
from worker.engine.input_batch import BatchBuilder, InputBatch
from worker.engine.kv_manager import KVCacheManager
from worker.engine.sampling import ParamStaging, SamplingRow, build_sampling_batch
from worker.model.attention import ForwardBatch

BLOCK = 4
CPU = torch.device("cpu")


class FakeRequests:
    """Requests whose block tables change as the KV manager's do: appended to, cut (a new
    version), a block swapped for its cached twin (a new version), gone and back (a new table)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tables: dict[str, tuple[list[int], int]] = {}
        self._versions = itertools.count(1)
        self._ids = itertools.count()

    def new_version(self, rid: str, table: list[int]) -> None:
        self.tables[rid] = (table, next(self._versions))

    def evolve(self) -> None:
        rng = self.rng
        for rid in list(self.tables):
            table, version = self.tables[rid]
            kind = rng.random()
            if kind < 0.5:
                table += [rng.randrange(1, 500) for _ in range(rng.randrange(0, 3))]  # in place
            elif kind < 0.6 and len(table) > 1:
                self.new_version(rid, table[:rng.randrange(1, len(table))])
            elif kind < 0.7:
                table[rng.randrange(len(table))] = rng.randrange(1, 500)
                self.new_version(rid, table)
            elif kind < 0.8:
                del self.tables[rid]
        for _ in range(rng.randrange(0, 4)):
            table = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 6))]
            self.new_version(f"r{next(self._ids)}", table)

    def step(self) -> tuple[BatchBuilder, int]:
        """A step over a random subset of the requests: prompt chunks first, then decodes."""
        rng, builder = self.rng, BatchBuilder(BLOCK, CPU)
        chosen = [rid for rid in self.tables if rng.random() < 0.8] or list(self.tables)[:1]
        num_prefills = rng.randrange(len(chosen) + 1)
        for i, rid in enumerate(chosen):
            table, version = self.tables[rid]
            capacity = len(table) * BLOCK
            n = rng.randrange(1, min(capacity, 9 if i < num_prefills else 3) + 1)
            start = rng.randrange(capacity - n + 1)
            builder.add(table, [rng.randrange(100) for _ in range(n)], start, 1 if i < num_prefills else n,
                        rng.choice([-1, 0, 1]), rid, version)
        return builder, num_prefills


def assert_same(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "logits_indices",
                 "lora_slots"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.block_tables.is_contiguous()
    for batch in (got, want):  # the host's copy FlashInfer plans from, without a device read
        assert batch.block_tables_host is not None and batch.block_tables_host.device.type == "cpu"
        assert batch.block_tables_host.dtype == torch.int32
        assert torch.equal(batch.block_tables_host, batch.block_tables.cpu())
    assert (got.query_start_loc, got.context_lens_host, got.num_prefills) == (
        want.query_start_loc, want.context_lens_host, want.num_prefills)


@pytest.mark.parametrize("seed", range(8))
def test_every_step_equals_the_list_builders_tensors(seed: int) -> None:
    rng = random.Random(seed)
    requests, inputs = FakeRequests(rng), InputBatch(CPU, num_tokens=4, num_seqs=2, num_blocks=2)
    for _ in range(60):
        requests.evolve()
        if not requests.tables:
            continue
        builder, num_prefills = requests.step()
        adapters = () if rng.random() < 0.5 else ("a",)  # only whether lora_slots is given matters here
        got = inputs.build(builder, num_prefills, adapters)  # type: ignore[arg-type]
        assert_same(got, builder.build(num_prefills, adapters))  # type: ignore[arg-type]
        assert inputs.num_rows == len(builder.request_ids)  # requests not in the step gave their rows back


def test_a_steady_state_allocates_nothing_and_keeps_its_buffers() -> None:
    inputs = InputBatch(CPU, num_tokens=2, num_seqs=1, num_blocks=1)
    tables = {f"r{i}": [10 * i + 1] for i in range(6)}

    def step(n: int) -> ForwardBatch:
        builder = BatchBuilder(BLOCK, CPU)
        for rid, table in tables.items():
            if len(table) * BLOCK <= n:
                table.append(table[-1] + 1)  # decoding grows the table in place
            builder.add(table, [7], n, 1, -1, rid, 1)
        return inputs.build(builder, 0)

    for n in range(33):  # the tables widen to 9 blocks: the buffers double to 16
        step(n)
    allocated = inputs.num_allocations
    pointers = None
    for n in range(33, 61):  # up to 16 blocks: nothing to allocate
        batch = step(n)
        assert batch.block_tables[:, -1].tolist() == [t[-1] for t in tables.values()]
        ptrs = [t.data_ptr() for t in (batch.input_ids, batch.slot_mapping, batch.block_tables,
                                       batch.context_lens)]
        assert pointers is None or ptrs == pointers
        assert inputs.num_allocations == allocated
        pointers = ptrs


def test_the_kv_managers_table_version_changes_unless_blocks_were_only_appended() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, max_model_len=64, enable_prefix_caching=False)
    kv.allocate("a", list(range(6)))
    kv.allocate("b", list(range(6)))
    first = kv.table_version("a")
    assert first != kv.table_version("b")
    assert kv.grow("a", 13) and kv.table_version("a") == first  # appended: the same version
    kv.trim("a", 6)  # a speculative step's reserved tail given back
    assert kv.table_version("a") != first
    kv.free("a")
    kv.allocate("a", list(range(6)))
    assert kv.table_version("a") not in (first, kv.table_version("b"))  # a new table, a new version


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_an_engine_on_the_persistent_batch_answers_as_on_fresh_tensors(native: bool) -> None:
    """CUDA's path (InputBatch, forced on here) through preemption in a tiny pool, a shared cached
    prefix and n-gram speculation. (The table versions are checked by the random steps above:
    here a trimmed tail's blocks usually come back from the pool with the same ids.)"""
    hf = make_hf_model()
    shared = make_prompts(1, lengths=(12,), seed=3)[0]
    prompts = [shared + p * 3 for p in make_prompts(6, lengths=(3, 5, 2, 4))]  # repeats: n-gram proposals
    params = [greedy(16) if i % 2 else SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=i)
              for i in range(6)]
    results = []
    for persistent in (False, True):
        engine = make_engine(ours_from_hf(hf, native=native), num_seqs=6, num_blocks=16,
                             max_prefill_tokens=16, num_speculative_tokens=2)
        if persistent:
            engine.runner.inputs = InputBatch(CPU)
            engine.runner.sampler.staging = ParamStaging.on(CPU)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        results.append(run_to_completion(engine))
        engine.kv.check()
    assert engine.scheduler.num_preemptions > 0 and engine.runner.inputs is not None
    staging = engine.runner.sampler.staging
    assert staging is not None and staging.ints.num_allocations >= 1
    assert results[1] == results[0]


def test_sampling_parameters_staged_in_buffers_allocated_once_equal_new_tensors() -> None:
    """The sampler's columns through ParamStaging (CUDA's path) are the fresh tensors' values, for
    batches that grow and shrink; once the largest batch was seen nothing is allocated."""
    rng = random.Random(0)
    staging = ParamStaging.on(CPU)
    for step in range(60):
        n = rng.randrange(0, 40) if step < 30 else rng.randrange(0, 33)
        rows = [SamplingRow(SamplingParams(temperature=rng.random(), top_k=rng.randrange(5),
                                           top_p=rng.random(), min_p=rng.random() / 2),
                            rng.randrange(2**64), [], list(range(rng.randrange(9)))) for _ in range(n)]
        if step == 30:
            allocated = (staging.floats.num_allocations, staging.ints.num_allocations)
        got = build_sampling_batch(rows, 50, CPU, staging=staging)
        want = build_sampling_batch(rows, 50, CPU)
        for name in ("temperatures", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seeds", "steps"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (staging.floats.num_allocations, staging.ints.num_allocations) == allocated
