"""`tokenrelay bench`: the metric maths on hand-made timings, the datasets and arrival times,
and a short run against a real gateway + worker whose JSON and PNGs are checked."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gateway import bench, cli
from gateway.bench_report import RequestResult, compute_metrics, format_block, inter_token_latencies
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.engine.sim import SimConfig, SimEngine


def make_results() -> list[RequestResult]:
    """A: 4 tokens (the last chunk carries 2); B: 1 token; C: refused by the gateway."""
    a = RequestResult(start_s=0.0, end_s=0.5, finish_reason="LENGTH", chunk_times_s=[0.1, 0.2, 0.4],
                      chunk_num_tokens=[1, 1, 2], prompt_tokens=10, queue_time_s=0.02)
    b = RequestResult(start_s=0.5, end_s=0.8, finish_reason="EOS", chunk_times_s=[0.3], chunk_num_tokens=[1],
                      prompt_tokens=20, queue_time_s=0.04)
    c = RequestResult(start_s=0.2, end_s=0.25, status="UNAVAILABLE", error="no gateway")
    return [a, b, c]


def test_inter_token_latencies_spread_a_multi_token_chunk_over_its_tokens() -> None:
    assert inter_token_latencies([0.1, 0.2, 0.4], [1, 1, 2]) == pytest.approx([0.1, 0.1, 0.1])
    assert inter_token_latencies([0.1], [3]) == []


def test_metrics_follow_vllm_definitions() -> None:
    m = compute_metrics(make_results(), 1.0, slos_ms={"ttft": 200.0}, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["status_counts"] == {"OK": 2, "UNAVAILABLE": 1}
    assert m["finish_reason_counts"] == {"LENGTH": 1, "EOS": 1, "none": 1}
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 5)
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 5.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["p99_ttft_ms"] == pytest.approx(298)
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)  # only A has more than one token
    assert m["mean_itl_ms"] == pytest.approx(100) and m["p50_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(400)
    assert m["mean_queue_time_ms"] == pytest.approx(30)
    assert m["request_goodput"] == 1.0  # A meets ttft <= 200 ms, B (300 ms) does not
    assert m["max_concurrent_requests"] == 2  # A with C; A ends as B starts
    assert sum(m["timeline"]["output_tok_s"]) * m["timeline"]["bin_s"][0] == pytest.approx(5)


def test_goodput_needs_every_slo_and_single_token_requests_have_zero_tpot() -> None:
    results = make_results()
    m = compute_metrics(results, 2.0, slos_ms={"ttft": 400.0, "tpot": 100.0}, percentiles=())
    assert m["request_goodput"] == 0.5  # A's TPOT is 133 ms; B's counts as 0
    assert compute_metrics(results, 2.0, slos_ms={}, percentiles=())["request_goodput"] is None


def test_printed_block_has_the_vllm_lines_and_the_status_counts() -> None:
    m = compute_metrics(make_results(), 1.0, slos_ms={"ttft": 200.0}, percentiles=(99,))
    block = format_block(m, request_rate=math.inf, max_concurrency=None, percentiles=(99,))
    for label, value in (("Successful requests:", "2"), ("Failed requests:", "1"),
                         ("Request goodput (req/s):", "1.00"), ("UNAVAILABLE:", "1"),
                         ("Median TTFT (ms):", "200.00"), ("Mean E2EL (ms):", "400.00"),
                         ("P99 ITL (ms):", ""), ("Mean TPOT (ms):", ""), ("Mean queue time (ms):", "")):
        assert f"{label:<40} {value}" in block, label


def test_arrivals_are_gamma_with_the_requested_mean_and_inf_means_all_at_once() -> None:
    assert not bench.arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).any()
    for burstiness in (0.5, 1.0, 4.0):
        offsets = bench.arrival_offsets(4000, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff(offsets)
        assert offsets[0] == 0 and gaps.mean() == pytest.approx(0.1, rel=0.08)
        assert gaps.var() == pytest.approx(0.01 / burstiness, rel=0.25)  # gamma: k * theta^2


def test_datasets(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    synthetic = bench.make_requests(bench.BenchConfig(num_requests=4, input_len=12, output_len=5), rng)
    assert [len(r.prompt.split()) for r in synthetic if r.prompt] == [12] * 4
    assert all(r.max_tokens == 5 and r.ignore_eos for r in synthetic)
    config = bench.BenchConfig(num_requests=3, dataset="shared-prefix", system_prompt_len=40, input_len=4)
    chats = [r.messages for r in bench.make_requests(config, rng) if r.messages]
    assert len({m[0] for m in chats}) == 1 and len({m[1] for m in chats}) == 3
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hi", "max_tokens": 3}\n\n'
                    '{"messages": [{"role": "user", "content": "Yo"}]}\n')
    rows = bench.make_requests(bench.BenchConfig(num_requests=3, dataset="jsonl", dataset_path=str(path),
                                                 output_len=7), rng)
    assert [(r.prompt, r.messages, r.max_tokens) for r in rows] == [
        ("Hi", None, 3), (None, (("user", "Yo"),), 7), ("Hi", None, 3)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        bench.load_jsonl(path, 7, False)


def test_cli_flags_become_the_config() -> None:
    args = cli.build_parser().parse_args(["bench", "--target", "h:1", "--sweep", "2", "inf", "--goodput",
                                          "ttft:500", "tpot:50", "--metric-percentiles", "50,99"])
    config = bench.config_from_args(args)
    assert config.target == "h:1" and config.request_rates == (2.0, math.inf)
    assert (config.model, config.adapter) == ("", "")  # the deployment's default, the base model
    args = cli.build_parser().parse_args(["bench", "--model", "org/m", "--adapter", "fr"])
    assert (bench.config_from_args(args).model, bench.config_from_args(args).adapter) == ("org/m", "fr")
    assert config.slos_ms == {"ttft": 500.0, "tpot": 50.0} and config.percentiles == (50.0, 99.0)
    with pytest.raises(ValueError, match="goodput"):
        bench.BenchConfig(slos_ms={"latency": 1.0})


def check_run(run: dict, num_requests: int, output_len: int) -> None:
    """One run's summary against its own per-request data and the requests it sent."""
    requests = run["requests"]
    assert run["completed"] == num_requests and run["failed"] == 0
    assert run["status_counts"] == {"OK": num_requests}
    assert run["finish_reason_counts"] == {"LENGTH": num_requests}
    assert requests["output_lens"] == [output_len] * num_requests  # ignore_eos + max_tokens: exact
    assert run["total_output_tokens"] == num_requests * output_len
    assert run["total_input_tokens"] == sum(requests["input_lens"]) and min(requests["input_lens"]) >= 16
    assert run["duration"] > 0 and run["request_throughput"] == pytest.approx(num_requests / run["duration"])
    assert run["output_throughput"] == pytest.approx(num_requests * output_len / run["duration"])
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # the SLO is generous
    assert run["mean_ttft_ms"] == pytest.approx(np.mean(requests["ttfts_ms"]))
    assert run["mean_e2el_ms"] == pytest.approx(np.mean(requests["e2els_ms"]))
    itls = [x for gaps in requests["itls_ms"] for x in gaps]
    assert 0 < len(itls) <= num_requests * (output_len - 1)
    assert run["mean_itl_ms"] == pytest.approx(np.mean(itls))
    for ttft, e2el in zip(requests["ttfts_ms"], requests["e2els_ms"], strict=True):
        assert 0 < ttft <= e2el
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < run[f"p50_{metric}_ms"] <= run[f"p99_{metric}_ms"]
    assert 0 <= run["mean_queue_time_ms"] <= run["mean_ttft_ms"]  # the server's queue time is inside TTFT
    assert run["max_concurrent_requests"] >= 1


def check_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 400


@pytest.mark.slow
def test_bench_against_a_real_stack(tmp_path: Path, make_gateway: Callable[..., GatewayThread],
                                    make_worker: Callable[..., WorkerThread],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    gateway, _ = make_gateway(), make_worker()
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=60, interval=0.1)
        config = bench.BenchConfig(target=gateway.target, num_requests=6, request_rates=(20.0, math.inf),
                                   input_len=16, output_len=8, seed=3, slos_ms={"e2el": 60_000.0},
                                   percentiles=(50.0, 99.0), timeout_s=60,
                                   result_json=str(tmp_path / "r.json"), plot_dir=str(tmp_path / "plots"))
        asyncio.run(bench.run(config))
        wait_until(lambda: num_finished(stub) == 12, timeout=10, interval=0.1)  # exactly the calls it made
    out = capsys.readouterr()
    assert out.out.count("Serving Benchmark Result") == 2 and "OK:" in out.out
    assert "6/6" in out.err  # the progress bar

    document = json.loads((tmp_path / "r.json").read_text())
    assert [run["request_rate"] for run in document["runs"]] == [20.0, "inf"]
    for run in document["runs"]:
        check_run(run, num_requests=6, output_len=8)
    paced, burst = (max(run["requests"]["start_s"]) for run in document["runs"])
    assert burst < 1.0 and paced > burst  # Poisson arrivals at 20/s vs all at once
    names = sorted(Path(p).name for p in document["plots"])
    assert names == ["itl_cdf.png", "latency_vs_throughput.png", "timeline.png", "ttft_cdf.png"]
    for name in names:
        check_png(tmp_path / "plots" / name)


def num_finished(stub: generate_pb2_grpc.TokenRelayStub) -> int:
    info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)
    return sum(w.num_finished for w in info.workers)


def test_bench_runs_a_named_model_and_adapter(tmp_path: Path, make_gateway: Callable[..., GatewayThread],
                                              start_worker: Callable[..., WorkerThread]) -> None:
    """--model/--adapter reach the requests: an adapter the worker has runs, one it lacks is
    counted as NOT_FOUND (the gateway's answer), not sent to the base model."""
    start_worker(SimEngine(SimConfig(step_ms=1, ms_per_token=0), adapters=("fr",)), served_model_name="alpha")
    gateway = make_gateway(models=())
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10, interval=0.1)
        counts = {}
        for adapter in ("fr", "de"):
            out = tmp_path / f"{adapter}.json"
            config = bench.BenchConfig(target=gateway.target, num_requests=3, input_len=8, output_len=4,
                                       model="alpha", adapter=adapter, result_json=str(out),
                                       is_progress_enabled=False, timeout_s=30)
            asyncio.run(bench.run(config))
            counts[adapter] = json.loads(out.read_text())["runs"][0]["status_counts"]
    assert counts == {"fr": {"OK": 3}, "de": {"NOT_FOUND": 3}}

