"""Run the real gateway and workers inside the test process (threads), or workers
as real `python -m worker` processes, against a real Redis."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple

import grpc
import redis
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.config import GatewayConfig
from gateway.process import Gateway
from gateway.queue import connect as connect_redis
from gateway.sweeper import Sweeper
from protos.keys import Keys
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig
from worker.io.consumer import Consumer
from worker.io.held import TextEngineProtocol

ROOT = Path(__file__).resolve().parent.parent


class GatewayThread:
    """A real grpc.aio gateway on 127.0.0.1:<free port>, on its own event loop thread."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.gateway: Gateway | None = None
        self.target = ""

    def start(self) -> GatewayThread:
        self._thread.start()
        port = self.call(self._start(), timeout=30)
        self.target = f"127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        self.gateway = Gateway(self.config)
        return await self.gateway.start()

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.gateway is not None:
            self.call(self.gateway.stop(grace_s=1), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class SweeperThread:
    """A gateway's sweeper alone (gateway/sweeper.py), on its own event loop thread: what fences
    dead workers and queues their requests again where a test runs workers without a gateway."""

    def __init__(self, config: GatewayConfig, models: tuple[str, ...] = (DEFAULT_MODEL_NAME,)) -> None:
        self.loop = asyncio.new_event_loop()
        self._client = connect_redis(config)
        self.sweeper = Sweeper(self._client, config, self._served)
        self._models = list(models)
        self._thread = threading.Thread(target=self.loop.run_forever, name="sweeper", daemon=True)
        self._task: concurrent.futures.Future[None] | None = None

    async def _served(self) -> list[str]:
        return self._models

    def start(self) -> SweeperThread:
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self.sweeper.run(), self.loop)
        return self

    def __enter__(self) -> SweeperThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class WorkerThread:
    """A real Consumer driving an in-process engine on a thread."""

    def __init__(self, engine: TextEngineProtocol, config: WorkerConfig) -> None:
        self.config = config
        self.consumer = Consumer(engine, config)
        self._thread = threading.Thread(target=self.consumer.run, name=config.worker_id, daemon=True)

    def start(self) -> WorkerThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30) -> None:
        self.consumer.stop()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "worker did not stop"


class WorkerProcess:
    """`python -m worker` as a child process (loads its own model)."""

    def __init__(self, redis_url: str, key_prefix: str, worker_id: str, *extra: str) -> None:
        args = [sys.executable, "-m", "worker", "--redis-url", redis_url, "--key-prefix", key_prefix,
                "--worker-id", worker_id, "--log-level", "WARNING", "--metrics-port", "0", *extra]
        self.worker_id = worker_id
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


class GatewayProcess:
    """`python -m gateway` as a child process, so a test can SIGKILL it."""

    def __init__(self, redis_url: str, key_prefix: str, *extra: str, log: IO[bytes] | None = None) -> None:
        """log: where its output goes (default: the test's)."""
        from gateway.redis_server import free_port

        self.target = f"127.0.0.1:{free_port()}"
        # queued for before a worker is up, as make_gateway's (the test workers' default name)
        models = () if "--models" in extra else ("--models", DEFAULT_MODEL_NAME)
        args = [sys.executable, "-m", "gateway", "--listen", self.target, "--redis-url", redis_url,
                "--key-prefix", key_prefix, "--log-level", "WARNING", "--metrics-port", "0", *models,
                *extra]
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stdout=log, stderr=log)

    def wait_serving(self, timeout: float = 30) -> GatewayProcess:
        def serving() -> bool:
            assert self.proc.poll() is None, f"the gateway exited with {self.proc.returncode}"
            return is_serving(self.target)
        wait_until(serving, timeout=timeout, interval=0.1)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def is_serving(target: str) -> bool:
    """The gateway at `target` answers its health check with SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return status.status == health_pb2.HealthCheckResponse.SERVING


def scrape_samples(port: int) -> list[Sample]:
    """Every sample of the /metrics page on 127.0.0.1:port, parsed by prometheus-client."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def stub_for(target: str) -> tuple[grpc.Channel, generate_pb2_grpc.TokenRelayStub]:
    channel = grpc.insecure_channel(target)
    return channel, generate_pb2_grpc.TokenRelayStub(channel)


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """Poll `predicate` until truthy (returns it) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def workers_ready(stub: generate_pb2_grpc.TokenRelayStub, n: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return len(stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=2).workers) >= n
        except grpc.RpcError:
            return False
    return check


def flush_prefix(redis_url: str, keys: Keys) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=f"{keys.prefix}:*"))
        if names:
            client.delete(*names)
    finally:
        client.close()


class MetricsStack(NamedTuple):
    """conftest's metrics_stack: a stub of a gateway with a ready worker, both exporting /metrics."""

    stub: generate_pb2_grpc.TokenRelayStub
    gateway_port: int
    worker_port: int
