"""`tokenrelay demo` and `tokenrelay up` + `tokenrelay-client`, as a user runs them:
real processes, an embedded Redis, the default model; nothing may be left running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.redis_server import free_port
from tests.service import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture
def marked_env() -> Iterator[dict[str, str]]:
    """An environment whose marker every child process inherits, to find leftovers."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded Redis path
    yield {**env, "TOKENRELAY_TEST_MARK": mark, "TOKENRELAY_NUM_THREADS": "1"}
    leftovers = marked_processes(mark)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"left running: {[p.cmdline() for p in leftovers]}"


def marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TOKENRELAY_TEST_MARK") == mark:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def test_demo_streams_an_answer_and_cleans_up(marked_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "demo", "--max-tokens", "12"], cwd=ROOT,
                          env=marked_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "generated tokens" in proc.stderr


@contextlib.contextmanager
def tokenrelay_up(env: dict[str, str], *args: str) -> Iterator[str]:
    """`tokenrelay up ARGS` until its "tokenrelay is up" line (yielded); then Ctrl-C must stop it
    with status 0. Killed if the test failed first."""
    up = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert up.stdout is not None
        # ends if `up` exits early; the pytest timeout bounds a hang
        line = next((line for line in up.stdout if "tokenrelay is up" in line), "")
        assert up.poll() is None and line, "tokenrelay up exited during start-up"
        yield line
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_serves_the_client_cli_and_stops_cleanly_on_ctrl_c(marked_env: dict[str, str]) -> None:
    target, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    with tokenrelay_up(marked_env, "--listen", target, "--metrics-port", str(metrics_port)):
        client = subprocess.run(
            [sys.executable, "-m", "gateway.client", "--target", target, "--chat", "--max-tokens", "12",
             "--temperature", "0", "What is the capital of France?"],
            cwd=ROOT, env=marked_env, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert "Paris" in client.stdout
        assert "generated tokens" in client.stderr
        for port in (metrics_port, metrics_port + 1):  # the gateway's, then the worker's
            scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert "tokenrelay_" in scrape


def test_up_on_port_0_reports_the_port_the_gateway_bound(marked_env: dict[str, str]) -> None:
    """Port 0: the gateway binds a free port itself and the launcher dials what it printed
    (choosing a port for it raced with other processes' connections)."""
    with tokenrelay_up(marked_env, "--listen", "127.0.0.1:0", "--workers", "0") as line:
        target = line.split("gRPC on ")[1].split(",")[0]
        host, _, port = target.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0, target
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
