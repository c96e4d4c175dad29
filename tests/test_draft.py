"""Speculative decoding with a draft model (worker/engine/draft.py): two random Llama models,
the output identical to plain decoding, the draft's own KV cache kept consistent, and the
start-up checks of factory.build_draft_model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protos.params import SamplingParams
from tests.factories import VOCAB, greedy, make_engine, make_hf_model, make_prompts, ours_from_hf, write_model
from tests.test_speculative import PARAMS, assert_same, repetitive_prompts, run, spec_engine
from worker.engine.config import EngineConfig
from worker.engine.core import EngineCore
from worker.engine.draft import DraftProposer
from worker.engine.kv_manager import KVCacheManager
from worker.model.llama import KVCache, LlamaModel
from worker.model.static_decode import StaticDecode


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return ours_from_hf(make_hf_model())


@pytest.fixture(scope="module")
def draft() -> LlamaModel:
    """Another random model, one layer: it agrees with the target only sometimes."""
    return ours_from_hf(make_hf_model(seed=1, num_layers=1))


def draft_engine(target: LlamaModel, draft: LlamaModel, k: int, *, draft_blocks: int = 256,
                 max_prefill_tokens: int = 512, static: bool = False, **kw: Any) -> EngineCore:
    """Every sequence speculates in every step, with `draft`'s proposals (blocks of 4 tokens);
    static: the draft's decode passes through static buffers (eager here, CUDA graphs on CUDA)."""
    engine = spec_engine(target, k, max_prefill_tokens=max_prefill_tokens, **kw)
    cache = KVCache(draft.config, draft_blocks + int(static), 4, torch.float32, draft.device)
    kv = KVCacheManager(draft_blocks, 4, 128, enable_prefix_caching=False)
    buffers = StaticDecode(draft, cache, engine.scheduler.max_num_seqs, 128 // 4, capture=False) if static \
        else None
    engine.proposer = DraftProposer(draft, cache, kv, max_prefill_tokens, buffers)
    return engine


def draft_kv(engine: EngineCore) -> KVCacheManager:
    assert isinstance(engine.proposer, DraftProposer)
    return engine.proposer.kv


@pytest.mark.parametrize("name", ["greedy-logprobs", "temperature-top-p", "penalties", "min-p"])
def test_a_copy_of_the_target_as_draft_is_always_accepted(target: LlamaModel, name: str) -> None:
    """Coupled drafting: a draft that computes what the target computes draws, with the same
    noise, the target's own tokens, seeded sampling included, so every proposal is accepted."""
    prompts, params = make_prompts(3), [PARAMS[name]] * 3
    want = run(make_engine(target), prompts, params)
    engine = draft_engine(target, target, 4)
    assert_same(run(engine, prompts, params), want)
    assert engine.num_spec_draft_tokens > 0
    assert engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_same_output_with_another_model_as_draft(target: LlamaModel, draft: LlamaModel, k: int) -> None:
    """Mixed steps (chunked prefills, plain decodes, verified runs), more requests than slots,
    every sampling setting; the draft catches up in chunks of max_prefill_tokens."""
    prompts = repetitive_prompts(6)
    params = [list(PARAMS.values())[i % len(PARAMS)] for i in range(6)]
    kw: dict[str, Any] = {"num_seqs": 3, "max_prefill_tokens": 8}
    want = run(make_engine(target, **kw), prompts, params)
    engine = draft_engine(target, draft, k, **kw)
    assert_same(run(engine, prompts, params), want)
    assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens  # some, not all
    kv = draft_kv(engine)
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks  # finished sequences gave the draft's blocks back


def test_the_draft_through_static_buffers_proposes_exactly_what_it_proposes_without(
        target: LlamaModel) -> None:
    """The draft's passes go through its own model runner: with static decode buffers (the
    CUDA-graph step, eager on CPU) every proposal is the same. A copy of the target as the draft
    makes each pass count: every proposal is accepted only if every pass computed exactly."""
    prompts = repetitive_prompts(5)
    params = [list(PARAMS.values())[i % len(PARAMS)] for i in range(5)]
    runs = []
    for static in (False, True):
        engine = draft_engine(target, target, 3, num_seqs=3, max_prefill_tokens=8, static=static)
        answers = run(engine, prompts, params)
        runs.append((answers, engine.num_spec_draft_tokens, engine.num_spec_accepted_tokens))
        assert isinstance(engine.proposer, DraftProposer)
        static_steps = engine.proposer.runner.static.num_steps if engine.proposer.runner.static else 0
        assert (static_steps > 10) == static
        assert engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens > 0
    assert_same(runs[1][0], runs[0][0])
    assert runs[1][1:] == runs[0][1:]


def test_preemption_a_full_draft_pool_and_resumes_change_nothing(target: LlamaModel,
                                                                  draft: LlamaModel) -> None:
    """The target preempts (24 blocks for 4 sequences) and the draft's pool has room for about
    one sequence: those without room propose nothing and catch up later. Then another worker
    resumes each request after 5 streamed tokens."""
    prompts = make_prompts(4, (9, 17))
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=7 + i, logprobs=True) for i in range(4)]
    want = run(make_engine(target), prompts, params)
    engine = draft_engine(target, draft, 4, num_blocks=24, draft_blocks=12)
    assert_same(run(engine, prompts, params), want)
    assert engine.scheduler.num_preemptions > 0 and engine.num_spec_drafts > 0
    draft_kv(engine).check()
    resumed = draft_engine(target, draft, 4)
    refs = [[t for t, _, _ in want[f"r{i}"]] for i in range(4)]
    for i in range(4):
        resumed.add_request(f"r{i}", prompts[i], params[i], seed=7 + i, resume_ids=refs[i][:5])
    got = run(resumed, [], [])
    assert [refs[i][:5] + [t for t, _, _ in got[f"r{i}"]] for i in range(4)] == refs
    assert resumed.num_spec_drafts > 0


def test_the_draft_cache_follows_rollbacks(target: LlamaModel, draft: LlamaModel) -> None:
    """After every step the draft holds K/V only for tokens that are the sequence's own
    (stale drafts past a rejection are trimmed before the next proposal) and its block
    tables cover what it holds."""
    engine = draft_engine(target, draft, 4)
    prompts = make_prompts(2, (5, 11))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(30))
    proposer = engine.proposer
    assert isinstance(proposer, DraftProposer)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running.values():
            held = proposer._cached.get(seq.request_id)
            if held is None:
                continue
            tokens = seq.prompt_ids + seq.output_ids
            n = next((i for i, (a, b) in enumerate(zip(held.token_ids, tokens, strict=False)) if a != b),
                     len(held.token_ids))
            assert n >= len(seq.prompt_ids)  # the prompt is never recomputed once cached
            assert len(held.token_ids) - n <= 3  # at most k - 1 stale drafts, trimmed next step
            assert len(proposer.kv.block_table(seq.request_id)) * 4 >= len(held.token_ids)
        proposer.kv.check()
    assert engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens  # there were rollbacks


# -- start-up: factory.build_text_engine -----------------------------------------------------------


def test_build_text_engine_with_a_draft_model(tmp_path: Path) -> None:
    from protos.params import PromptInput
    from worker.factory import build_text_engine

    base = dict(model=write_model(tmp_path / "target", seed=0), max_num_seqs=2, max_model_len=64,
                kv_cache_memory_mb=1, num_threads=1)
    plain = build_text_engine(EngineConfig(**base))
    spec = build_text_engine(EngineConfig(**base, speculative="draft", num_speculative_tokens=3,
                                          draft_model=write_model(tmp_path / "draft", seed=1, num_layers=1)))
    assert isinstance(spec.engine.proposer, DraftProposer)
    assert spec.engine.kv.num_blocks == spec.engine.proposer.kv.num_blocks  # one budget, split
    assert spec.engine.kv.num_blocks < plain.engine.kv.num_blocks
    assert "draft" in spec.weights
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    outs = []
    for engine in (plain, spec):
        engine.add_request("a", PromptInput(prompt="t5 t9 t5 t9 t5 t9 t7"), params)
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.token_ids]
        outs.append(tokens)
    assert outs[0] == outs[1] and len(outs[0]) == 12
    assert spec.engine.num_spec_drafts > 0


@pytest.mark.parametrize(("draft_kw", "message"), [
    ({"renamed": 17}, "does not share the target's tokenizer: token 't17' is id 17 vs None"),
    ({"vocab_size": VOCAB + 64}, "does not share the target's tokenizer: vocab_size 128 vs 192"),
])
def test_a_draft_with_another_tokenizer_stops_the_start(tmp_path: Path, draft_kw: dict[str, Any],
                                                        message: str) -> None:
    from worker.factory import build_text_engine

    config = EngineConfig(model=write_model(tmp_path / "target", seed=0), max_model_len=64,
                          kv_cache_memory_mb=1, speculative="draft",
                          draft_model=write_model(tmp_path / "draft", seed=1, **draft_kw))
    with pytest.raises(ValueError, match=message):
        build_text_engine(config)


@pytest.mark.parametrize("kw", [{"speculative": "draft"}, {"speculative": "ngram", "draft_model": "d.gguf"},
                                {"draft_model": "d.gguf"}])
def test_config_pairs_draft_and_draft_model(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="speculative 'draft' needs draft_model"):
        EngineConfig(**kw)


def test_the_worker_refuses_a_mismatched_draft_with_a_message(tmp_path: Path) -> None:
    import subprocess
    import sys

    target = write_model(tmp_path / "target", seed=0)
    draft = write_model(tmp_path / "draft", seed=1, renamed=3)
    proc = subprocess.run([sys.executable, "-m", "worker", "--model", target, "--max-model-len", "64",
                           "--kv-cache-memory-mb", "1", "--speculative", "draft", "--draft-model", draft,
                           "--redis-url", "redis://127.0.0.1:1"],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "does not share the target's tokenizer: token 't3'" in proc.stderr
    assert "Traceback" not in proc.stderr
