"""LoRA adapters in the engine: batch invariance, cache scopes, loading and unloading between
steps, at most max_adapters per step without starving anyone."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from protos.params import FinishReason, SamplingParams  # noqa: E402
from tests.factories import greedy, make_engine, make_hf_model, make_prompts, run_to_completion  # noqa: E402
from tests.lora_factories import adapter_tensors, lora_engine, write_adapter  # noqa: E402
from worker.engine.core import EngineCore  # noqa: E402
from worker.engine.kv_manager import KVCacheManager  # noqa: E402
from worker.engine.scheduler import Scheduler  # noqa: E402
from worker.engine.sequence import Sequence  # noqa: E402
from worker.engine.stopping import StoppingCriteria  # noqa: E402
from worker.model.lora import TARGET_MODULES  # noqa: E402


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return make_hf_model()


@pytest.fixture(scope="module")
def folders(hf, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Three random rank-4 adapters by name: a and b over all seven modules, c over three (so a
    step has matmuls that some of its adapters leave alone)."""
    root = tmp_path_factory.mktemp("adapters")
    modules = {"a": TARGET_MODULES, "b": TARGET_MODULES, "c": ("q_proj", "v_proj", "down_proj")}
    return {name: write_adapter(root / name, adapter_tensors(hf, seed=seed, modules=modules[name]))
            for seed, name in enumerate(("a", "b", "c"), start=1)}


def loaded(engine: EngineCore, folders: dict[str, str]) -> EngineCore:
    assert engine.adapters is not None
    for name, folder in folders.items():
        engine.adapters.load(name, folder)
    return engine


@pytest.mark.parametrize(("native", "quantize_to"), [(False, None), (True, None), (True, "q8_0")],
                         ids=["torch", "native", "native-q8_0"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_each_request_gets_its_tokens_alone_whatever_shares_its_batch(hf, folders, native: bool,  # type: ignore[no-untyped-def]
                                                                      quantize_to: str | None,
                                                                      sampled: bool) -> None:
    """Three adapters and the base model in one batch, prompts chunked next to decodes: every
    request's tokens are bit for bit those it gets alone, base requests' included."""
    prompts = make_prompts(8, lengths=(3, 17, 9, 30), seed=5)
    names = ["a", "b", "", "c", "b", "a", "c", ""]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=10, temperature=0.9, seed=i) if sampled else greedy(10)

    engine = loaded(lora_engine(hf, native=native, quantize_to=quantize_to, max_prefill_tokens=24,
                                enable_prefix_caching=False), folders)
    alone, base = {}, {}
    for i, (p, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", p, params(i), adapter=name)
        alone.update(run_to_completion(engine))
        engine.add_request(f"r{i}", p, params(i))
        base.update(run_to_completion(engine))
    for i, (p, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}", p, params(i), adapter=name)
    assert run_to_completion(engine) == alone
    changed = [alone[f"r{i}"] != base[f"r{i}"] for i, name in enumerate(names) if name]
    assert sum(changed) >= 4, "the adapters must change most answers, else this shows little"


def test_prompt_blocks_are_shared_only_under_the_same_adapter_and_load(hf, folders) -> None:  # type: ignore[no-untyped-def]
    engine = loaded(lora_engine(hf), folders)
    prompt = make_prompts(1, lengths=(17,), seed=6)[0]  # 4 full blocks of 4

    def cached(adapter: str) -> int:
        seq = engine.add_request(f"x{cached.n}", prompt, greedy(2), adapter=adapter)  # type: ignore[attr-defined]
        cached.n += 1  # type: ignore[attr-defined]
        run_to_completion(engine)
        return seq.num_cached_tokens

    cached.n = 0  # type: ignore[attr-defined]
    assert [cached("a"), cached("b"), cached("a"), cached(""), cached("")] == [0, 0, 16, 0, 16]
    engine.unload_adapter("a")
    engine.adapters.load("a", folders["b"])  # type: ignore[union-attr]  # same name, other weights
    assert cached("a") == 0


def test_an_adapter_loaded_at_run_time_serves_the_next_request(hf, folders) -> None:  # type: ignore[no-untyped-def]
    engine = lora_engine(hf)
    prompt = make_prompts(1, lengths=(9,), seed=7)[0]
    engine.add_request("base", prompt, greedy(6))
    engine.step()
    engine.adapters.load("b", folders["b"])  # type: ignore[union-attr]
    engine.add_request("lora", prompt, greedy(6), adapter="b")
    got = run_to_completion(engine)
    reference = loaded(lora_engine(hf), {"b": folders["b"]})
    reference.add_request("lora", prompt, greedy(6), adapter="b")
    assert got["lora"] == run_to_completion(reference)["lora"] and len(got["lora"]) == 6


def test_unloading_refuses_new_requests_and_frees_after_those_in_flight(hf, folders) -> None:  # type: ignore[no-untyped-def]
    engine = loaded(lora_engine(hf, num_seqs=1), folders)
    adapters = engine.adapters
    assert adapters is not None
    prompts = make_prompts(2, lengths=(9, 5), seed=8)
    engine.add_request("running", prompts[0], greedy(8), adapter="a")
    engine.add_request("waiting", prompts[1], greedy(8), adapter="a")  # one slot: it waits
    first = [o.token.token_id for o in engine.step() if o.token]
    engine.unload_adapter("a")
    assert adapters.names == ("b", "c") and "a" in adapters.loaded
    with pytest.raises(ValueError, match=r"^adapter 'a' is unloading; loaded: b, c$"):
        engine.add_request("late", prompts[0], greedy(8), adapter="a")
    got = run_to_completion(engine)
    assert adapters.loaded == ("b", "c")  # freed once both finished
    fresh = loaded(lora_engine(hf), {"a": folders["a"]})
    for rid, p in zip(("running", "waiting"), prompts, strict=True):
        fresh.add_request(rid, p, greedy(8), adapter="a")
    want = run_to_completion(fresh)
    assert first + got["running"] == want["running"] and got["waiting"] == want["waiting"]
    with pytest.raises(ValueError, match=r"^adapter 'a' is not loaded; loaded: b, c$"):
        engine.add_request("later", prompts[0], greedy(8), adapter="a")
    engine.unload_adapter("b")  # nothing uses it: freed at once
    assert adapters.loaded == ("c",)


def test_unknown_adapters_and_names_are_refused(hf, folders, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = loaded(lora_engine(hf), {"a": folders["a"]})
    with pytest.raises(ValueError, match=r"^adapter 'nope' is not loaded; loaded: a$"):
        engine.add_request("x", [5, 6], greedy(2), adapter="nope")
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
        engine.unload_adapter("nope")
    with pytest.raises(ValueError, match="is already loaded"):
        engine.adapters.load("a", folders["a"])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="must match"):
        engine.adapters.load("a/b", folders["a"])  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="is not a folder"):
        engine.adapters.load("d", tmp_path / "missing")  # type: ignore[union-attr]
    assert engine.adapters.names == ("a",)  # type: ignore[union-attr]
    plain = make_engine()
    with pytest.raises(ValueError, match=r"^adapter 'a': this worker serves no LoRA adapters"):
        plain.add_request("x", [5, 6], greedy(2), adapter="a")
    with pytest.raises(ValueError, match="enable_lora"):
        EngineCore(plain.model, num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=1,
                   max_prefill_tokens=8, eos_token_ids=frozenset(), max_adapters=2)


def _seq(request_id: str, adapter: str, num_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=4)
    return Sequence(request_id, [hash(request_id) % 1000 + i for i in range(num_tokens)], params, seed=0,
                    stopping=StoppingCriteria(params, frozenset(), 4), adapter=adapter)


def test_a_step_runs_at_most_max_adapters_and_a_further_one_waits_without_starving() -> None:
    """Adapters a and b run; c's request waits at the head (no later one overtakes it, even of a
    running adapter) until a has no request left, then runs next to b."""
    sched = Scheduler(KVCacheManager(100, 4, max_model_len=64), max_num_seqs=8, max_prefill_tokens=64,
                      max_adapters=2)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("base", ""), ("c1", "c"), ("a2", "a")):
        sched.add(_seq(rid, adapter))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["a1", "b1", "base"]
    assert [s.request_id for s in sched.waiting] == ["c1", "a2"]
    sched.commit(out)
    sched.finish(sched.running["a1"], FinishReason.STOP)
    out = sched.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["c1"]  # a2 would make three
    assert {s.adapter for s in sched.running.values()} == {"b", "c", ""}
    assert [s.request_id for s in sched.waiting] == ["a2"]


def test_each_row_carries_its_adapters_slot_in_the_step(hf, folders) -> None:  # type: ignore[no-untyped-def]
    engine = loaded(lora_engine(hf), folders)
    for i, name in enumerate(("c", "a", "", "c")):
        engine.add_request(f"r{i}", [5 + i, 7, 9], greedy(3), adapter=name)
    engine.step()
    batch = engine.runner.prepare([], list(engine.scheduler.running.values()))
    assert batch.lora_slots is not None and batch.lora_slots.tolist() == [0, 1, -1, 0]
    assert [a.name for a in batch.adapters] == ["c", "a"]  # the step's adapters, first seen first
    base_only = engine.runner.prepare([], [engine.scheduler.running["r2"]])
    assert base_only.lora_slots is None and base_only.adapters == ()
