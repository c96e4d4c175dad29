"""What Redis writes per token, from outside, on a private Redis: flat in the output length
(progress is O(1) per round; benchmarks/fleet.py measures the rest at scale)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from gateway.config import GatewayConfig
from gateway.redis_server import EmbeddedRedis
from protos.convert import build_request
from tests.service import GatewayThread, WorkerThread, stub_for, wait_until, workers_ready
from worker.config import WorkerConfig
from worker.engine.sim import SimConfig, SimEngine, sim_token_ids


@pytest.fixture
def stack() -> Iterator[tuple[redis.Redis, str]]:
    with EmbeddedRedis() as server:
        engine = SimEngine(SimConfig(step_ms=0.5, ms_per_token=0.0), max_num_seqs=4, max_model_len=8192)
        config = WorkerConfig(redis_url=server.url, key_prefix="costs", claim_block_ms=100)
        worker = WorkerThread(engine, config)
        worker.start()
        gateway = GatewayThread(GatewayConfig(listen="127.0.0.1:0", redis_url=server.url,
                                              key_prefix="costs")).start()
        client = redis.Redis.from_url(server.url)
        try:
            yield client, gateway.target
        finally:
            gateway.stop()
            worker.stop()
            client.close()


def bytes_per_token(client: redis.Redis, target: str, num_tokens: int, seed: int) -> float:
    channel, stub = stub_for(target)
    with channel:
        wait_until(workers_ready(stub, 1), timeout=10)
        before = int(client.info("stats")["total_net_input_bytes"])
        request = build_request("Once upon a time", max_tokens=num_tokens, seed=seed, ignore_eos=True)
        responses = list(stub.Generate(request, timeout=120))
        after = int(client.info("stats")["total_net_input_bytes"])
    ids = [t for r in responses[:-1] for t in r.chunk.token_ids]
    assert ids == sim_token_ids(seed, 0, num_tokens)
    return (after - before) / num_tokens


@pytest.mark.slow
def test_bytes_written_per_token_do_not_grow_with_the_output(stack: tuple[redis.Redis, str]) -> None:
    client, target = stack
    short = bytes_per_token(client, target, 64, seed=1)
    long = bytes_per_token(client, target, 4096, seed=2)
    # Before O(1) progress: 1,025 bytes/token at 64 tokens and 3,295 at 3,000 (each round rewrote
    # every token so far). The fixed cost of a request (ATTACH, the entry, heartbeats) is spread
    # over more tokens in the long answer, so it may only be cheaper.
    print(f"redis bytes per token: {short:.0f} at 64 tokens, {long:.0f} at 4,096")
    assert long <= 1.5 * short, (short, long)
