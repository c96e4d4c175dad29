"""Prometheus endpoints of a real gateway and a real worker, scraped after real calls and
parsed with prometheus-client's own text parser (issue 10)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gateway.redis_server import free_port
from protos.convert import build_request
from tests.factories import make_stats
from tests.service import GatewayThread, MetricsStack, scrape_samples, stub_for, wait_until
from worker.io.metrics import WorkerMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value for s in scrape_samples(port)}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.mark.slow
def test_counts_and_histograms_match_the_calls_made(metrics_stack: MetricsStack) -> None:
    stub, gateway_port, worker_port = metrics_stack
    calls = [list(stub.Generate(build_request(f"Count to {i}.", max_tokens=5 + i, temperature=0.0,
                                              ignore_eos=True), timeout=60)) for i in range(3)]
    finals = [c[-1].final for c in calls]
    g = wait_until(lambda: (s := scrape(gateway_port)) and
                   value(s, "tokenrelay_e2e_request_latency_seconds_count") == 3 and s, timeout=5)
    completion_tokens = sum(f.usage.completion_tokens for f in finals)
    assert value(g, "tokenrelay_generation_tokens_total") == completion_tokens == 18
    assert value(g, "tokenrelay_prompt_tokens_total") == sum(f.usage.prompt_tokens for f in finals)
    assert value(g, "tokenrelay_time_to_first_token_seconds_count") == 3
    assert value(g, "tokenrelay_inter_token_latency_seconds_count") == 18 - 3  # gaps between chunks
    assert value(g, "tokenrelay_request_queue_time_seconds_count") == 3
    assert value(g, "tokenrelay_request_success_total", finished_reason="length") == 3
    assert value(g, "tokenrelay_requests_inflight") == 0
    assert value(g, "tokenrelay_requests_rejected_total") == 0
    generate = {"grpc_service": "tokenrelay.v1.TokenRelay", "grpc_method": "Generate"}
    assert value(g, "grpc_server_started_total", **generate) == 3
    assert value(g, "grpc_server_handled_total", grpc_code="OK", **generate) == 3
    assert value(g, "grpc_server_msg_sent_total", **generate) == sum(len(c) for c in calls)
    model = next(dict(ls)["model"] for (n, ls) in g if n == "tokenrelay_generation_tokens_total")
    assert model.startswith("SmolLM2")

    w = wait_until(lambda: (s := scrape(worker_port)) and
                   value(s, "tokenrelay_request_decode_time_seconds_count") == 3 and s, timeout=5)
    assert value(w, "tokenrelay_request_prefill_time_seconds_count") == 3
    assert value(w, "tokenrelay_engine_step_seconds_count", kind="prefill") >= 1
    assert value(w, "tokenrelay_engine_step_seconds_count", kind="decode") >= 1
    steps = value(w, "tokenrelay_engine_step_seconds_count")
    assert value(w, "tokenrelay_iteration_tokens_count") == steps
    # Every prompt token and every decoded token but the ones sampled at prefill is computed once.
    computed = sum(f.usage.prompt_tokens - f.usage.cached_prompt_tokens + f.usage.completion_tokens - 1
                   for f in finals)
    assert value(w, "tokenrelay_iteration_tokens_sum") == computed
    assert value(w, "tokenrelay_prefix_cache_queries_total") >= value(w, "tokenrelay_prefix_cache_hits_total")
    assert value(w, "tokenrelay_num_requests_running") == value(w, "tokenrelay_num_requests_waiting") == 0
    assert value(w, "tokenrelay_redis_errors_total") == 0
    assert {dict(ls).get("worker") for (n, ls) in w if n == "tokenrelay_num_requests_running"} != {None}


def test_rejections_queue_gauges_and_vllm_names(make_gateway: Callable[..., GatewayThread]) -> None:
    port = free_port()
    gateway = make_gateway(metrics_port=port, metrics_compat="vllm", max_queue_depth=1)
    channel, stub = stub_for(gateway.target)
    with channel:
        queued = stub.Generate(build_request("Wait for a worker.", max_tokens=4), timeout=30)  # none runs
        wait_until(lambda: value(scrape(port), "tokenrelay_queue_depth") == 1, timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(build_request("One too many.", max_tokens=4), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(build_request("Bad.", max_tokens=-1), timeout=10))
        samples = scrape(port)
        queued.cancel()
    assert value(samples, "tokenrelay_requests_rejected_total", reason="queue_full") == 1
    assert value(samples, "tokenrelay_requests_rejected_total", reason="invalid") == 1
    assert value(samples, "tokenrelay_requests_inflight") == 1
    assert value(samples, "tokenrelay_queue_pending") == 0
    assert value(samples, "tokenrelay_queue_oldest_waiting_age_seconds") > 0
    assert value(samples, "grpc_server_handled_total", grpc_code="RESOURCE_EXHAUSTED") == 1
    # The same series under vLLM's names, model -> model_name, for dashboards built on vLLM.
    assert value(samples, "vllm:requests_rejected_total", reason="queue_full") == 1
    assert all("model_name" in dict(ls) and "model" not in dict(ls)
               for (n, ls) in samples if n.startswith("vllm:"))


def test_lora_requests_info_names_the_running_adapters_in_one_series() -> None:
    """vLLM's lora_requests_info: one series, whose labels say which adapters run (and the most
    per step); a change replaces it. A worker without LoRA shows max_lora 0 and none running."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "m", "w", max_adapters=4)

    def series() -> list[dict[str, str]]:
        return [s.labels for f in registry.collect() for s in f.samples
                if s.name == "tokenrelay_lora_requests_info"]

    metrics.update(make_stats(num_running_by_adapter={"fr": 2, "de": 0, "it": 1}), 0)
    assert [(s["running_lora_adapters"], s["max_lora"]) for s in series()] == [("fr,it", "4")]
    metrics.update(make_stats(num_running_by_adapter={"fr": 0, "de": 3}), 0)
    assert [s["running_lora_adapters"] for s in series()] == ["de"]
    off = CollectorRegistry()
    WorkerMetrics(off, "m", "w").update(make_stats(), 0)
    assert [(s.labels["max_lora"], s.labels["running_lora_adapters"]) for f in off.collect()
            for s in f.samples if s.name == "tokenrelay_lora_requests_info"] == [("0", "")]
