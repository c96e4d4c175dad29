"""Every command a newcomer types answers --help, and the console scripts resolve."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from typing import TYPE_CHECKING

import pytest

from tests.service import ROOT

if TYPE_CHECKING:
    from worker.config import WorkerConfig


def worker_config(argv: list[str], env: dict[str, str], names: tuple[str, ...],
                  monkeypatch: pytest.MonkeyPatch) -> WorkerConfig:
    """The worker's config from argv with exactly `env` set among the variables `names`."""
    from worker.__main__ import config_from_args

    for name in names:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return config_from_args(argv)[0]

COMMANDS = {  # module run with -m -> words its --help must mention
    "gateway.cli": ["up", "demo", "--help"],
    "gateway.client": ["--chat", "--max-tokens", "--temperature", "--seed", "--stop", "--target"],
    "gateway": ["--listen", "--redis-url", "--max-queue-depth", "REDIS_URL"],
    "worker": ["--redis-url", "--model", "--max-num-seqs", "--drain-timeout", "REDIS_URL"],
}


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for word in COMMANDS[module]:
        assert word in out, f"{module} --help does not mention {word}"


@pytest.mark.parametrize("subcommand", ["up", "demo"])
def test_launcher_subcommand_help(subcommand: str) -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", subcommand, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--redis-url" in out and "--workers" in out


def test_bad_flag_value_is_a_clean_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "worker", "--max-num-seqs", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "max_num_seqs must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_console_scripts_resolve() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("tokenrelay", "tokenrelay-gateway", "tokenrelay-worker", "tokenrelay-client"):
        module, _, func = scripts[name].partition(":")
        assert callable(getattr(importlib.import_module(module), func)), name


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, (True, True)),
    (["--no-native-kernels", "--no-prefix-caching"], {}, (False, False)),
    ([], {"TOKENRELAY_NATIVE_KERNELS": "0", "TOKENRELAY_PREFIX_CACHING": "false"}, (False, False)),
    (["--native-kernels"], {"TOKENRELAY_NATIVE_KERNELS": "0"}, (True, True)),  # a flag beats the env
])
def test_worker_engine_switches_from_flags_and_env(argv: list[str], env: dict[str, str],
                                                   expected: tuple[bool, bool],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    config = worker_config(argv, env, ("TOKENRELAY_NATIVE_KERNELS", "TOKENRELAY_PREFIX_CACHING"), monkeypatch)
    assert (config.engine.enable_native_kernels, config.engine.enable_prefix_caching) == expected


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, "auto"),
    (["--quantization", "q4_0"], {}, "q4_0"),
    ([], {"TOKENRELAY_QUANTIZATION": "none"}, "none"),
])
def test_worker_quantization_from_flag_and_env(argv: list[str], env: dict[str, str], expected: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert worker_config(argv, env, ("TOKENRELAY_QUANTIZATION",), monkeypatch).engine.quantization == expected


def test_an_unknown_quantization_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "worker", "--quantization", "q2_k"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--quantization" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, ("none", None)),
    (["--speculative", "draft", "--draft-model", "small.gguf"], {}, ("draft", "small.gguf")),
    ([], {"TOKENRELAY_SPECULATIVE": "draft", "TOKENRELAY_DRAFT_MODEL": "d/"}, ("draft", "d/")),
])
def test_worker_draft_model_from_flags_and_env(argv: list[str], env: dict[str, str],
                                               expected: tuple[str, str | None],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("TOKENRELAY_SPECULATIVE", "TOKENRELAY_DRAFT_MODEL")
    engine = worker_config(argv, env, names, monkeypatch).engine
    assert (engine.speculative, engine.draft_model) == expected


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, ((), False, "")),
    (["--adapter", "fr=/a/fr", "--adapter", "de=/a/de"], {"TOKENRELAY_ADAPTERS": "x=/x"},
     ((("fr", "/a/fr"), ("de", "/a/de")), True, "")),  # the flags replace the variable's
    ([], {"TOKENRELAY_ADAPTERS": "fr=/a/fr,de=/a/de", "TOKENRELAY_SERVED_MODEL_NAME": "org/m"},
     ((("fr", "/a/fr"), ("de", "/a/de")), True, "org/m")),
    (["--enable-lora", "--served-model-name", "m"], {}, ((), True, "m")),
])
def test_worker_models_and_adapters_from_flags_and_env(argv: list[str], env: dict[str, str],
                                                      expected: tuple[object, bool, str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("TOKENRELAY_ADAPTERS", "TOKENRELAY_ENABLE_LORA", "TOKENRELAY_SERVED_MODEL_NAME")
    config = worker_config(argv, env, names, monkeypatch)
    assert (config.engine.adapters, config.engine.is_lora_enabled, config.served_model_name) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["--adapter", "fr"], "expected NAME=PATH"),
    (["--adapter", "bad name=/x"], "adapters: name 'bad name'"),
    (["--served-model-name", "a:b"], "served_model_name must be 1-128 characters"),
])
def test_bad_model_and_adapter_flags_are_clean_usage_errors(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "worker", "--engine", "sim", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "env", "cpu", "cuda"), [
    ([], {}, (512, None), (8192, 8192)),
    (["--max-num-batched-tokens", "2048"], {}, (512, 2048), (2048, 2048)),
    (["--max-prefill-tokens", "64"], {"TOKENRELAY_MAX_NUM_BATCHED_TOKENS": "1024"}, (64, 1024), (64, 1024)),
])
def test_worker_step_budgets_from_flags_env_and_device(argv: list[str], env: dict[str, str],
                                                       cpu: tuple[int, int | None],
                                                       cuda: tuple[int, int | None],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("TOKENRELAY_MAX_PREFILL_TOKENS", "TOKENRELAY_MAX_NUM_BATCHED_TOKENS")
    engine = worker_config(argv, env, names, monkeypatch).engine
    assert (engine.step_budgets(is_cuda=False), engine.step_budgets(is_cuda=True)) == (cpu, cuda)


def test_a_token_budget_below_max_num_seqs_is_refused() -> None:
    from worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)


def test_acl_prints_a_per_worker_user_line_and_refuses_a_glob_in_the_worker_id() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "acl", "worker", "--worker-id", "w1",
                          "--password-sha256", "ab" * 32], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.startswith(f"user worker-w1 on #{'ab' * 32} resetkeys") and "&tokenrelay:out:w1.?????? " in out
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "acl", "worker", "--worker-id", "w*"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "worker id" in bad.stderr and "Traceback" not in bad.stderr
