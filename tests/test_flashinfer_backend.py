"""The flashinfer backend's calls (worker/model/flashinfer_backend.py) against a torch stand-in of
FlashInfer's wrappers (tests/fake_flashinfer.py), on the CPU: its dynamic steps attend as the
torch backend does, and its static decode steps (the CUDA-graph steps) plan one decode wrapper
per bucket before each step and give exactly the dynamic steps' tokens. What FlashInfer's own
kernels do needs a GPU and has not run (docs/gpu.md)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests import fake_flashinfer
from tests.factories import greedy, make_engine, make_hf_model, make_prompts, ours_from_hf, run_to_completion
from worker.engine.sampling import SamplingParams
from worker.model import flashinfer_backend
from worker.model.flashinfer_backend import FlashInferBackend
from worker.model.llama import LlamaModel
from worker.model.static_decode import StaticDecode

MAX_LEN = 64


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(flashinfer_backend, "is_available", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "require_cuda", lambda device: None)


def on_flashinfer(model: LlamaModel) -> LlamaModel:
    model.attention = FlashInferBackend(model.device, model.config.num_heads, model.dtype)
    return model


def answers(model: LlamaModel, static: bool) -> tuple[dict[str, list[int]], int]:
    """Greedy and seeded requests over chunked prompts and decodes; (tokens, static steps)."""
    engine = make_engine(model, num_seqs=5, max_len=MAX_LEN, max_prefill_tokens=16, static_decode=static)
    for i, prompt in enumerate(make_prompts(5, lengths=(3, 21, 9, 30))):
        sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
        params = greedy(max_tokens=16) if i % 2 else sampled
        engine.add_request(f"r{i}", prompt, params, seed=i)
    out = run_to_completion(engine)
    return out, engine.runner.static.num_steps if engine.runner.static is not None else 0


def test_static_steps_plan_a_decode_wrapper_per_bucket_and_answer_as_dynamic_steps(fake: None) -> None:
    model = on_flashinfer(ours_from_hf(make_hf_model(max_position_embeddings=MAX_LEN), native=False))
    dynamic, _ = answers(model, static=False)
    static, num_static = answers(model, static=True)
    assert num_static > 10 and static == dynamic
    backend = model.attention
    assert isinstance(backend, FlashInferBackend)
    wrappers = backend._static  # one per bucket a step used, each planned before each of its steps
    assert set(wrappers) <= {1, 2, 4, 5} and sum(w.num_plans for w in wrappers.values()) == num_static


def test_dynamic_steps_attend_as_the_torch_backend(fake: None) -> None:
    """Prompt chunks, decodes and mixed steps through FlashInfer's page metadata: the torch
    backend's greedy tokens (both run SDPA over the same keys; the orders of their sums may
    differ, so this compares tokens of a random model whose top two logits are far apart)."""
    hf = make_hf_model(max_position_embeddings=MAX_LEN)
    want, _ = answers(ours_from_hf(hf, native=False), static=False)
    got, _ = answers(on_flashinfer(ours_from_hf(hf, native=False)), static=False)
    assert {k: v for k, v in got.items() if int(k[1]) % 2} == {k: v for k, v in want.items() if int(k[1]) % 2}


def test_a_static_step_without_its_plan_is_refused(fake: None) -> None:
    model = on_flashinfer(ours_from_hf(make_hf_model(max_position_embeddings=MAX_LEN), native=False))
    cache = model.new_cache(8, 4)
    static = StaticDecode(model, cache, 2, 4, capture=False)
    with pytest.raises(RuntimeError, match="plan comes first"):
        model.forward(static.batch(2), cache)
    assert static.run([1], [0], [0], [[0]]).shape == (1, model.config.vocab_size)  # run plans it
    assert torch.isfinite(static.run([1, 2], [0, 1], [0, 1], [[0], [0]])).all()
