"""LoRA through the worker's front: EngineConfig's fields, the factory, TextEngine's API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from protos.params import PromptInput  # noqa: E402
from tests.factories import greedy, make_hf_model  # noqa: E402
from tests.lora_factories import adapter_tensors, write_adapter  # noqa: E402
from tests.test_draft import write_model  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.text_engine import TextEngine  # noqa: E402


@pytest.mark.parametrize(("kw", "message"), [
    ({"adapters": (("a b", "/x"),)}, r"adapters: name 'a b' must match"),
    ({"adapters": (("a", "/x"), ("a", "/y"))}, "names must be unique, got a more than once"),
    ({"adapters": (("a", ""),)}, "pairs of non-empty strings"),
    ({"adapters": ("a",)}, "pairs of non-empty strings"),
    ({"max_adapters": 0}, r"max_adapters must be in \[1, 64\]"),
    ({"max_lora_rank": 0}, r"max_lora_rank must be in \[1, 512\]"),
])
def test_config_checks_the_lora_fields(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_lora_is_on_with_enable_lora_or_any_adapter() -> None:
    assert not EngineConfig().is_lora_enabled
    assert EngineConfig(enable_lora=True).is_lora_enabled
    assert EngineConfig(adapters=(("a", "/x"),)).is_lora_enabled


def _generate(engine: TextEngine, rid: str, adapter: str = "") -> list[int]:
    prompt = PromptInput(prompt="t5 t9 t5 t7 t11")
    engine.add_request(rid, prompt, greedy(6, ignore_eos=True), adapter=adapter)
    ids: list[int] = []
    while engine.has_unfinished():
        ids += [t for o in engine.step() for t in o.token_ids]
    return ids


def test_the_factory_loads_the_configured_adapters_and_the_text_engine_serves_them(tmp_path: Path) -> None:
    from worker.factory import build_text_engine

    hf = make_hf_model(seed=0)
    a = write_adapter(tmp_path / "a", adapter_tensors(hf, seed=1))
    b = write_adapter(tmp_path / "b", adapter_tensors(hf, seed=2))
    base = dict(model=write_model(tmp_path / "model", seed=0), max_num_seqs=4, max_model_len=64,
                kv_cache_memory_mb=1, num_threads=1)
    plain = build_text_engine(EngineConfig(**base))
    engine = build_text_engine(EngineConfig(**base, adapters=(("a", a),)))
    assert not plain.engine.model.is_lora_enabled and plain.adapters == ()
    assert engine.engine.model.is_lora_enabled and engine.adapters == ("a",)
    with pytest.raises(ValueError, match="^adapter 'a': this worker serves no LoRA adapters"):
        plain.add_request("x", PromptInput(prompt="t5"), greedy(2), adapter="a")
    with pytest.raises(ValueError, match="LoRA is off"):
        plain.load_adapter("a", a)

    engine.load_adapter("b", b)
    assert engine.adapters == ("a", "b")
    engine.add_request("running", PromptInput(prompt="t5 t6"), greedy(4, ignore_eos=True), adapter="a")
    engine.step()
    assert engine.stats().num_running_by_adapter == {"a": 1, "b": 0}
    while engine.has_unfinished():
        engine.step()
    assert _generate(engine, "base") == _generate(plain, "base")
    assert _generate(engine, "a", "a") != _generate(engine, "b", "b")
    engine.unload_adapter("b")
    assert engine.adapters == ("a",) and engine.stats().num_running_by_adapter == {"a": 0}
    with pytest.raises(ValueError, match=r"^adapter 'b' is not loaded; loaded: a$"):
        engine.add_request("y", PromptInput(prompt="t5"), greedy(2), adapter="b")
