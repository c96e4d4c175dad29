"""The simulated engine (worker/engine/sim.py): the TextEngine contract without a model."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest

from protos.params import ChatMessage, FinishReason, PromptInput, SamplingParams
from worker.__main__ import config_from_args
from worker.config import WorkerConfig
from worker.engine.config import SimConfig
from worker.engine.outputs import RequestOutput, Resume
from worker.engine.sim import SimEngine, sim_prompt_tokens, sim_text, sim_token_ids


def make_sim(num_seqs: int = 4, max_len: int = 256, step_ms: float = 0.0, ms_per_token: float = 0.0,
             salt: str = "") -> SimEngine:
    return SimEngine(SimConfig(step_ms=step_ms, ms_per_token=ms_per_token, salt=salt),
                     max_num_seqs=num_seqs, max_model_len=max_len)


def prompt(chars: int = 10) -> PromptInput:
    return PromptInput(prompt="x" * chars)


def params(max_tokens: int = 8, seed: int | None = 7, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, **kw)


def run_all(engine: SimEngine, max_steps: int = 1000) -> dict[str, list[RequestOutput]]:
    """Step until idle; every request's outputs in order."""
    out: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    raise AssertionError("sim did not finish")


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_sim_token_ids_are_deterministic_and_sliceable() -> None:
    ids = sim_token_ids(42, 0, 50)
    assert ids == sim_token_ids(42, 0, 50)
    assert ids[10:20] == sim_token_ids(42, 10, 10)
    assert all(0 < t < 32000 for t in ids)
    assert ids != sim_token_ids(43, 0, 50)
    assert ids != sim_token_ids(42, 0, 50, salt="worker-b")


def test_request_tokens_are_the_seeds_and_final_text_is_the_chunks() -> None:
    engine = make_sim()
    engine.add_request("a", prompt(), params(max_tokens=12, seed=5))
    outs = run_all(engine)["a"]
    assert tokens(outs) == sim_token_ids(5, 0, 12)
    assert text(outs) == "".join(sim_text(t) for t in sim_token_ids(5, 0, 12))
    final = outs[-1]
    assert final.finish_reason is FinishReason.LENGTH and final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.seed) == (3, 12, 5)
    assert final.usage.cached_prompt_tokens == 0


def test_seed_is_drawn_when_unset_and_reported() -> None:
    engine = make_sim()
    seed = engine.add_request("a", prompt(), params(max_tokens=4, seed=None)).seed
    assert tokens(run_all(engine)["a"]) == sim_token_ids(seed, 0, 4)


@pytest.mark.parametrize("k", [1, 5, 9])
def test_resume_continues_with_exactly_the_missing_tokens(k: int) -> None:
    full = make_sim()
    full.add_request("a", prompt(), params(max_tokens=10, seed=3))
    whole = run_all(full)["a"]
    resumed = make_sim()
    streamed = tuple(tokens(whole)[:k])
    admitted = resumed.add_request("a", prompt(), params(max_tokens=10, seed=None),
                                   resume=Resume(streamed, seed=3, first_token_unix=time.time()))
    rest = run_all(resumed)["a"]
    assert admitted.seed == 3
    assert tokens(rest) == tokens(whole)[k:]
    assert admitted.text + text(rest) == text(whole)
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 10


def test_resume_of_a_finished_request_only_sends_the_final() -> None:
    engine = make_sim()
    streamed = Resume(tuple(sim_token_ids(1, 0, 3)), seed=1)
    engine.add_request("a", prompt(), params(max_tokens=3, seed=1), resume=streamed)
    [out] = run_all(engine)["a"]
    assert out.token_ids == [] and out.finish_reason is FinishReason.LENGTH


def test_salt_changes_the_tokens() -> None:
    a, b = make_sim(salt=""), make_sim(salt="b")
    for engine in (a, b):
        engine.add_request("r", prompt(), params(max_tokens=6, seed=9))
    assert tokens(run_all(a)["r"]) != tokens(run_all(b)["r"])


def test_batching_waits_for_a_free_slot_and_all_finish() -> None:
    engine = make_sim(num_seqs=2)
    for i, n in enumerate((2, 5, 3)):
        engine.add_request(f"r{i}", prompt(), params(max_tokens=n, seed=i))
    first = engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_step_prefill_tokens) == (2, 1, 6)
    assert stats.num_free_blocks == stats.num_blocks - 2
    outs = run_all(engine)
    assert {r: len(tokens([o for o in first if o.request_id == r] + outs[r])) for r in outs} == {
        "r0": 2, "r1": 5, "r2": 3}
    assert engine.stats().num_running == engine.stats().num_waiting == 0


@pytest.mark.parametrize("request_id", ["running", "waiting"])
def test_abort_ends_a_running_or_waiting_request_in_the_next_step(request_id: str) -> None:
    engine = make_sim(num_seqs=1)
    engine.add_request("running", prompt(), params(max_tokens=100))
    engine.add_request("waiting", prompt(), params(max_tokens=100))
    engine.step()
    assert (engine.stats().num_running, engine.stats().num_waiting) == (1, 1)
    engine.abort(request_id)
    engine.abort("unknown")  # ignored, like EngineCore
    [out] = [o for o in engine.step() if o.request_id == request_id]
    assert out.finish_reason is FinishReason.ABORT and out.token_ids == [] and out.usage is not None
    assert (engine.stats().num_running, engine.stats().num_waiting) == (1, 0)


def test_stop_token_id_ends_with_stop() -> None:
    ids = sim_token_ids(11, 0, 20)
    stop = ids[6]
    engine = make_sim()
    engine.add_request("a", prompt(), params(max_tokens=20, seed=11, stop_token_ids=(stop,)))
    outs = run_all(engine)["a"]
    assert tokens(outs) == ids[:ids.index(stop) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_stop_string_ends_with_stop_and_drops_it() -> None:
    ids = sim_token_ids(11, 0, 20)
    engine = make_sim()
    engine.add_request("a", prompt(), params(max_tokens=20, seed=11, stop=(sim_text(ids[4]),)))
    outs = run_all(engine)["a"]
    assert text(outs) == "".join(sim_text(t) for t in ids[:4])
    assert outs[-1].finish_reason is FinishReason.STOP


def test_step_sleeps_the_modelled_time_and_not_when_idle() -> None:
    engine = make_sim(step_ms=30.0)
    start = time.perf_counter()
    assert engine.step() == []
    assert time.perf_counter() - start < 0.02
    engine.add_request("a", prompt(), params(max_tokens=2))
    start = time.perf_counter()
    engine.step()
    assert time.perf_counter() - start >= 0.03


def test_prompt_tokens_are_estimated_from_characters() -> None:
    assert sim_prompt_tokens(prompt(9)) == 3
    chat = PromptInput(messages=(ChatMessage("system", "x" * 4), ChatMessage("user", "y" * 5)))
    assert sim_prompt_tokens(chat) == 3


@pytest.mark.parametrize("max_tokens,chars,limit", [(64, 10, "context length (64)"),
                                                    (8, 400, "context of 64")])
def test_bad_input_raises_naming_the_limit(max_tokens: int, chars: int, limit: str) -> None:
    with pytest.raises(ValueError, match=re.escape(limit)):
        make_sim(max_len=64).add_request("a", prompt(chars), params(max_tokens=max_tokens))


def test_truncate_prompt_keeps_what_fits() -> None:
    engine = make_sim(max_len=64)
    engine.add_request("a", prompt(400), params(max_tokens=8, truncate_prompt=True))
    usage = run_all(engine)["a"][-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.truncated_prompt_tokens) == (56, 44)


def test_duplicate_request_id_is_refused() -> None:
    engine = make_sim()
    engine.add_request("a", prompt(), params())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", prompt(), params())


@pytest.mark.parametrize("kw", [{"step_ms": -1.0}, {"ms_per_token": -0.1}, {"step_ms": float("nan")}])
def test_sim_config_is_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="sim"):
        SimConfig(**kw)


def test_worker_config_checks_the_engine_kind() -> None:
    with pytest.raises(ValueError, match="engine_kind"):
        WorkerConfig(engine_kind="gpu")


def test_flags_build_the_sim_config() -> None:
    config, _ = config_from_args(["--engine", "sim", "--sim-step-ms", "5", "--sim-salt", "w1",
                                  "--max-num-seqs", "3"])
    assert config.engine_kind == "sim"
    assert config.sim == SimConfig(step_ms=5.0, ms_per_token=0.05, salt="w1")
    stats = SimEngine.from_config(config.sim, config.engine).stats()
    assert (stats.model_name, stats.max_num_seqs, stats.max_model_len) == ("sim", 3, 2048)
    assert config_from_args([])[0].engine_kind == "model"


def test_the_sim_and_the_flags_import_no_torch() -> None:
    code = ("import sys, worker.engine.sim, worker.__main__, worker.io.consumer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
