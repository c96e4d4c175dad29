"""Many models and adapters on one queue (protos/keys.py, "Models"; gateway/models.py): each
request runs on a worker of its model, with its adapter, or is refused naming what is served."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from gateway import cli, models
from protos.convert import build_request
from protos.keys import Keys
from protos.params import PromptInput, SamplingParams
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.factories import make_hf_model, write_model
from tests.service import GatewayThread, WorkerProcess, WorkerThread, stub_for, wait_until, workers_ready
from tests.test_e2e import run_in_process
from worker.config import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids

Stub = generate_pb2_grpc.TokenRelayStub


def sim(salt: str, adapters: tuple[str, ...] = ()) -> SimEngine:
    return SimEngine(SimConfig(step_ms=1, ms_per_token=0, salt=salt), max_num_seqs=8, adapters=adapters)


def tokens(responses: list[generate_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]


def server_info(stub: Stub) -> generate_pb2.ServerInfo:
    return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)


@pytest.fixture
def two_models(make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
               ) -> Iterator[tuple[Stub, dict[str, WorkerThread]]]:
    """Worker "a" serves model alpha (and its adapter "fr"), "b" serves beta; tokens salted apart."""
    workers = {"alpha": start_worker(sim("A", adapters=("fr",)), worker_id="a", served_model_name="alpha"),
               "beta": start_worker(sim("B"), worker_id="b", served_model_name="beta")}
    channel, stub = stub_for(make_gateway(models=(), liveness_check_s=0.5).target)
    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        yield stub, workers


def test_each_request_runs_on_a_worker_of_its_model(two_models: tuple[Stub, dict[str, WorkerThread]]) -> None:
    stub, _ = two_models
    for model, worker_id, salt in (("alpha", "a", "A"), ("beta", "b", "B"), ("alpha", "a", "A")):
        out = list(stub.Generate(build_request("hi", max_tokens=6, seed=3, model=model), timeout=30))
        assert out[-1].final.worker_id == worker_id
        assert tokens(out) == sim_token_ids(3, 0, 6, salt)


def test_a_request_with_an_adapter_runs_it(two_models: tuple[Stub, dict[str, WorkerThread]]) -> None:
    stub, _ = two_models
    request = build_request("hi", max_tokens=6, seed=3, model="alpha", adapter="fr")
    out = list(stub.Generate(request, timeout=30))
    assert tokens(out) == sim_token_ids(3, 0, 6, "A|fr") != sim_token_ids(3, 0, 6, "A")


@pytest.mark.parametrize(("fields", "code", "message"), [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "model is required: this deployment serves alpha, beta"),
    ({"model": "gamma"}, grpc.StatusCode.NOT_FOUND,
     "model 'gamma' is not served here: served are alpha, beta"),
    ({"model": "beta", "adapter": "fr"}, grpc.StatusCode.NOT_FOUND,
     "adapter 'fr' of model 'beta' is not loaded on any live worker: loaded are none"),
    ({"model": "alpha", "adapter": "de"}, grpc.StatusCode.NOT_FOUND, "loaded are fr"),
    ({"model": "a:b"}, grpc.StatusCode.INVALID_ARGUMENT, "model must be 1-128 characters"),
    ({"model": "alpha", "adapter": "x/y"}, grpc.StatusCode.INVALID_ARGUMENT,
     "adapter must be 1-64 characters"),
])
def test_what_is_not_served_is_refused_naming_what_is(
        two_models: tuple[Stub, dict[str, WorkerThread]], fields: dict[str, str], code: grpc.StatusCode,
        message: str) -> None:
    stub, _ = two_models
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(build_request("hi", max_tokens=2, **fields), timeout=10))
    assert e.value.code() == code
    assert message in (e.value.details() or "")


def test_a_model_whose_workers_all_left_stays_served_for_a_grace_period(
        two_models: tuple[Stub, dict[str, WorkerThread]], start_worker: Callable[..., WorkerThread],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a Redis outage longer than the heartbeat TTL, or while a model's only worker restarts,
    no live worker serves it for a while: a call then waits in the queue for the next one instead
    of ending NOT_FOUND; once SERVED_GRACE_S has passed without one, it is refused."""
    stub, workers = two_models
    workers["beta"].stop()  # leaving deletes its heartbeat at once
    wait_until(lambda: len(server_info(stub).workers) == 1, timeout=10)  # the gateway has read it gone
    request = build_request("hi", max_tokens=6, seed=3, model="beta")
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: list(stub.Generate(request, timeout=30)))
        time.sleep(1.0)
        assert not call.done()  # queued, not refused
        successor = start_worker(sim("B"), worker_id="b2", served_model_name="beta")
        out = call.result(timeout=30)
    assert out[-1].final.worker_id == "b2" and tokens(out) == sim_token_ids(3, 0, 6, "B")
    monkeypatch.setattr(models, "SERVED_GRACE_S", 0.0)
    successor.stop()
    wait_until(lambda: len(server_info(stub).workers) == 1, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model 'beta' is not served here: served are alpha" in (e.value.details() or "")


def test_server_info_lists_the_models_their_adapters_and_workers(
        two_models: tuple[Stub, dict[str, WorkerThread]]) -> None:
    stub, _ = two_models
    info = server_info(stub)
    assert list(info.models) == ["alpha", "beta"]
    assert [(m.name, list(m.adapters), m.num_workers, m.is_default) for m in info.served] == [
        ("alpha", ["fr"], 1, False), ("beta", [], 1, False)]
    assert {w.worker_id: list(w.adapters) for w in info.workers} == {"a": ["fr"], "b": []}


def test_the_default_model_runs_requests_without_one(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    start_worker(sim("A"), worker_id="a", served_model_name="alpha")
    start_worker(sim("B"), worker_id="b", served_model_name="beta")
    channel, stub = stub_for(make_gateway(models=(), default_model="beta").target)
    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        out = list(stub.Generate(build_request("hi", max_tokens=4, seed=1), timeout=30))
        # the body names the model it ran: a resend naming it attaches to the same request
        resent = list(stub.Generate(build_request("hi", max_tokens=4, seed=1, model="beta",
                                                  request_id=out[-1].request_id), timeout=30))
        assert [m.is_default for m in server_info(stub).served] == [False, True]
    assert out[-1].final.worker_id == "b" and tokens(out) == sim_token_ids(1, 0, 4, "B") == tokens(resent)


def test_a_declared_model_queues_without_workers_and_sheds_on_its_own_depth(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        redis_url: str, prefix: str) -> None:
    """--models gamma: queued for with no worker (KEDA scales it from zero); its full queue refuses
    gamma's calls, not beta's."""
    start_worker(sim("B"), worker_id="b", served_model_name="beta")
    channel, stub = stub_for(make_gateway(models=("gamma",), max_queue_depth=2, retry_pushback_ms=250).target)
    client = redis.Redis.from_url(redis_url)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        gamma_request = build_request("hi", max_tokens=2, model="gamma")
        waiting = [stub.Generate(gamma_request, timeout=30) for _ in range(2)]
        gamma = Keys(prefix, "gamma").requests
        wait_until(lambda: client.xlen(gamma) == 2, timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("hi", max_tokens=2, model="gamma"), timeout=10))
        beta = list(stub.Generate(build_request("hi", max_tokens=2, seed=4, model="beta"), timeout=30))
        served = [(m.name, m.num_workers) for m in server_info(stub).served]
        for call in waiting:
            call.cancel()
    client.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert tokens(beta) == sim_token_ids(4, 0, 2, "B")
    assert served == [("beta", 1), ("gamma", 0)]


@pytest.mark.slow
def test_a_worker_kill_with_two_models_in_flight_resumes_each_on_its_own_model(
        make_gateway: Callable[..., GatewayThread], redis_url: str, prefix: str) -> None:
    """Two sim worker processes per model, 16 seeded streams over both models; one worker of each
    model is SIGKILLed mid-stream. Every caller gets every token exactly once, the tokens of its
    own model (each model's workers salt them apart), and its final names a worker of that
    model: nothing crossed models, nothing was lost or repeated."""
    num_tokens = 60
    sim_args = ["--engine", "sim", "--sim-step-ms", "20", "--heartbeat-ttl", "1", "--max-num-seqs", "8"]
    procs = {f"{m}{i}": WorkerProcess(redis_url, prefix, f"{m}{i}", *sim_args, "--served-model-name", m,
                                      "--sim-salt", m) for m in ("alpha", "beta") for i in (0, 1)}
    channel, stub = stub_for(make_gateway(models=(), default_model="alpha", liveness_check_s=0.5).target)

    def call(i: int) -> tuple[str, list[generate_pb2.GenerateResponse]]:
        model = ("alpha", "beta")[i % 2]
        request = build_request("hi", max_tokens=num_tokens, seed=i, request_id=f"r{i}", ignore_eos=True,
                                model=model)
        return model, list(stub.Generate(request, timeout=90))

    try:
        with channel:
            wait_until(workers_ready(stub, 4), timeout=60)
            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(call, i) for i in range(16)]
                time.sleep(0.6)  # every stream has started: about a third of its tokens are out
                for name in ("alpha0", "beta1"):
                    os.kill(procs[name].proc.pid, signal.SIGKILL)
                results = [f.result() for f in futures]
    finally:
        for proc in procs.values():
            with contextlib.suppress(Exception):
                proc.stop(timeout=10)
    for i, (model, out) in enumerate(results):
        chunks = [r.chunk for r in out if r.HasField("chunk")]
        assert [c.index for c in chunks] == list(range(len(chunks)))  # no gap, no repeat
        assert tokens(out) == sim_token_ids(i, 0, num_tokens, model), f"stream r{i} of {model}"
        assert out[-1].final.worker_id.startswith(model)
    # a stream takes 1.2 s of decoding: none had finished on a killed worker
    assert {out[-1].final.worker_id for _, out in results} == {"alpha1", "beta0"}


def test_adapters_are_loaded_and_unloaded_at_run_time_through_redis(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        redis_url: str, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenrelay adapter load` reaches every worker of the model (and only them); the next request
    runs the adapter; after `unload` it is refused again. A worker started later loads what the
    hash holds."""
    engines = {"a": sim("A"), "b": sim("B")}
    start_worker(engines["a"], worker_id="a", served_model_name="alpha")
    start_worker(engines["b"], worker_id="b", served_model_name="beta")
    channel, stub = stub_for(make_gateway(models=()).target)

    def adapter(*argv: str) -> None:
        assert cli.main(["adapter", "--redis-url", redis_url, "--key-prefix", prefix, "--model", "alpha",
                         *argv]) == 0

    def served() -> dict[str, list[str]]:
        return {m.name: list(m.adapters) for m in server_info(stub).served}

    with channel:
        wait_until(workers_ready(stub, 2), timeout=10)
        adapter("load", "fr", "/adapters/fr")
        wait_until(lambda: served() == {"alpha": ["fr"], "beta": []}, timeout=10)
        request = build_request("hi", max_tokens=4, seed=2, model="alpha", adapter="fr")
        assert tokens(list(stub.Generate(request, timeout=30))) == sim_token_ids(2, 0, 4, "A|fr")
        later = sim("A2")
        start_worker(later, worker_id="a2", served_model_name="alpha")
        wait_until(lambda: later.adapters == ("fr",), timeout=10)  # from the hash, at its start
        adapter("list")
        assert capsys.readouterr().out.splitlines()[-1] == "fr\t/adapters/fr"
        adapter("unload", "fr")
        wait_until(lambda: served() == {"alpha": [], "beta": []}, timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert engines["b"].adapters == ()


@pytest.mark.slow
def test_two_real_models_each_answer_with_their_own_weights(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        smollm_engine: Any, tmp_path: Path) -> None:
    """SmolLM2 and a random Llama layout (its own word-level tokenizer) on one Redis: each request
    lands on a worker of its model and streams exactly what that model's engine gives in process."""
    from worker.factory import build_text_engine

    tiny = build_text_engine(EngineConfig(model=write_model(tmp_path / "tiny-random", seed=3), max_num_seqs=4,
                                          max_model_len=64, kv_cache_memory_mb=1, num_threads=1))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cases = {DEFAULT_MODEL_NAME: (smollm_engine, "The capital of France is"),
             "tiny-random": (tiny, "t5 t9 t7")}
    references = {model: [t for o in run_in_process(engine, PromptInput(prompt=prompt), params)
                          for t in o.token_ids] for model, (engine, prompt) in cases.items()}
    start_worker(smollm_engine, worker_id="smol")
    start_worker(tiny, worker_id="tiny", served_model_name="tiny-random")
    channel, stub = stub_for(make_gateway(models=()).target)
    with channel:
        wait_until(workers_ready(stub, 2), timeout=30)
        for model, (_, prompt) in [*cases.items(), *cases.items()]:
            out = list(stub.Generate(build_request(prompt, max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   model=model), timeout=120))
            assert out[-1].final.worker_id == ("smol" if model == DEFAULT_MODEL_NAME else "tiny")
            assert tokens(out) == references[model], model
    assert references[DEFAULT_MODEL_NAME] != references["tiny-random"]


@pytest.mark.slow
def test_real_lora_adapters_through_the_gateway_loaded_at_start_and_at_run_time(
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread],
        redis_url: str, prefix: str, tmp_path: Path) -> None:
    """A random Llama with adapter "fr" from its flags and "de" loaded at run time (`tokenrelay
    adapter load`): requests of both adapters and of the base, sent together so they share
    steps, stream exactly what a separate engine with both adapters gives each of them alone."""
    from tests.lora_factories import adapter_tensors, write_adapter
    from worker.factory import build_text_engine

    folder = write_model(tmp_path / "tiny", seed=3)
    hf = make_hf_model(seed=3)
    paths = {name: write_adapter(tmp_path / name, adapter_tensors(hf, seed=seed))
             for name, seed in (("fr", 1), ("de", 2))}
    base = dict(model=folder, max_num_seqs=8, max_model_len=64, kv_cache_memory_mb=1, num_threads=1)
    reference_engine = build_text_engine(EngineConfig(**base, adapters=tuple(paths.items())))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = "t5 t9 t7 t3"
    references = {adapter: alone(reference_engine, prompt, params, adapter) for adapter in ("", "fr", "de")}
    assert len({tuple(r) for r in references.values()}) == 3  # each adapter changes the answer

    worker = build_text_engine(EngineConfig(**base, adapters=(("fr", paths["fr"]),)))
    start_worker(worker, worker_id="tiny", served_model_name="tiny")
    channel, stub = stub_for(make_gateway(models=()).target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=30)
        assert cli.main(["adapter", "--redis-url", redis_url, "--key-prefix", prefix, "--model", "tiny",
                         "load", "de", paths["de"]]) == 0
        wait_until(lambda: [list(m.adapters) for m in server_info(stub).served] == [["de", "fr"]], timeout=10)

        def call(adapter: str) -> list[int]:
            request = build_request(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, model="tiny",
                                    adapter=adapter or None)
            return tokens(list(stub.Generate(request, timeout=60)))

        with ThreadPoolExecutor(6) as pool:
            adapters = ["fr", "", "de", "de", "", "fr"]
            results = list(pool.map(call, adapters))
    assert results == [references[a] for a in adapters]


def alone(engine: Any, prompt: str, params: SamplingParams, adapter: str) -> list[int]:
    """The tokens of one request run by itself in the engine."""
    engine.add_request(f"alone-{adapter}", PromptInput(prompt=prompt), params, adapter=adapter)
    ids: list[int] = []
    while engine.has_unfinished():
        ids += [t for o in engine.step() for t in o.token_ids]
    return ids
