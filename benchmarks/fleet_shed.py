"""The shedding test of benchmarks/fleet.py: how fast a full gateway says no.

A gateway with --max-queue-depth 16 on a key prefix no worker serves; 16 calls fill its
queue, then a burst of calls fired at once must all get RESOURCE_EXHAUSTED, and each
refusal's latency (its own send -> the error) is measured. The same burst from the same
client against a no-op grpc.aio server (on the gateway's event loop) that refuses every call
at once (no Redis) is
the floor: the part of the latency that is Python gRPC itself, on this machine, now.

    python benchmarks/fleet_shed.py --serve-refusing 127.0.0.1:PORT   (the floor's server)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from benchmarks.fleet_procs import SIM_MODEL, Child, Fleet  # noqa: E402
from benchmarks.fleet_stats import percentile  # noqa: E402
from gateway.__main__ import loop_factory  # noqa: E402
from gateway.redis_server import free_port  # noqa: E402
from protos.convert import build_request  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402

SHED_QUEUE_DEPTH = 16
CALL_TIMEOUT_S = 30.0
FILL_TIMEOUT_S = 20.0
CANCEL_TIMEOUT_S = 15.0


class RefusingServicer(generate_pb2_grpc.TokenRelayServicer):
    """Refuses every Generate at once, as a full gateway does, but without asking Redis."""

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (no-op reference)")
        yield generate_pb2.GenerateResponse()  # never reached: makes this a server-streaming handler

    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        return generate_pb2.ServerInfo()


async def serve_refusing(target: str) -> None:
    server = grpc.aio.server()
    generate_pb2_grpc.add_TokenRelayServicer_to_server(RefusingServicer(), server)
    server.add_insecure_port(target)
    await server.start()
    await server.wait_for_termination()


async def refusal_ms(stub: Any, outcomes: dict[str, int]) -> float | None:
    """Milliseconds until RESOURCE_EXHAUSTED; None for any other outcome (counted)."""
    request = build_request("fleet", max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    try:
        async for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            break  # admitted: the shedding failed
        outcomes["ADMITTED"] = outcomes.get("ADMITTED", 0) + 1
        return None
    except grpc.aio.AioRpcError as e:
        outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1
        is_refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return 1000 * (time.perf_counter() - start) if is_refused else None


async def burst(stub: Any, num_calls: int) -> tuple[list[float], dict[str, int]]:
    """A warm-up burst of SHED_QUEUE_DEPTH calls (not counted), then num_calls at once."""
    await asyncio.gather(*(refusal_ms(stub, {}) for _ in range(SHED_QUEUE_DEPTH)))
    outcomes: dict[str, int] = {}
    latencies = await asyncio.gather(*(refusal_ms(stub, outcomes) for _ in range(num_calls)))
    return [ms for ms in latencies if ms is not None], outcomes


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def fill(stub: Any) -> list[asyncio.Task[None]]:
    """SHED_QUEUE_DEPTH calls that wait in the queue (no worker), until the gateway counts them."""
    request = build_request("fleet", max_tokens=16, ignore_eos=True)
    fillers = [asyncio.ensure_future(_drain(stub.Generate(request, timeout=CALL_TIMEOUT_S + FILL_TIMEOUT_S)))
               for _ in range(SHED_QUEUE_DEPTH)]
    deadline = time.monotonic() + FILL_TIMEOUT_S
    depth = 0
    while time.monotonic() < deadline:
        depth = (await stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)).queue_depth
        if depth >= SHED_QUEUE_DEPTH:
            return fillers
        await asyncio.sleep(0.05)
    for task in fillers:
        task.cancel()
    raise RuntimeError(f"the shedding gateway's queue did not fill: depth {depth} of {SHED_QUEUE_DEPTH}")


async def measure(gateway_target: str, floor_target: str, num_calls: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(floor_target) as channel:
        floor, _ = await burst(generate_pb2_grpc.TokenRelayStub(channel), num_calls)
    async with grpc.aio.insecure_channel(gateway_target) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        fillers = await fill(stub)
        try:
            refused, outcomes = await burst(stub, num_calls)
        finally:
            for task in fillers:
                task.cancel()
            await asyncio.wait(fillers, timeout=CANCEL_TIMEOUT_S)
    return {"burst": num_calls, "queue_depth": SHED_QUEUE_DEPTH, "outcomes": outcomes,
            "reject_p50_ms": percentile(refused, 0.5), "reject_p99_ms": percentile(refused, 0.99),
            "reject_max_ms": max(refused, default=None),
            "floor_reject_p50_ms": percentile(floor, 0.5), "floor_reject_p99_ms": percentile(floor, 0.99)}


def shedding_test(redis_url: str, log_dir: Path, num_calls: int) -> dict[str, Any]:
    gateway_target, floor_target = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    gateway = Child("shed-gateway", ["-m", "gateway", "--listen", gateway_target, "--redis-url", redis_url,
                                     "--key-prefix", f"fleet-shed-{uuid.uuid4().hex[:6]}",
                                     "--max-queue-depth", str(SHED_QUEUE_DEPTH), "--shutdown-grace", "1",
                                     "--models", SIM_MODEL,  # queued for: no worker serves this prefix
                                     "--metrics-port", "0", "--log-level", "WARNING"],
                    log_dir / "shed-gateway.log")
    floor = Child("refusing-server", [__file__, "--serve-refusing", floor_target],
                  log_dir / "refusing-server.log")
    print(f"shedding: queue depth {SHED_QUEUE_DEPTH}, burst of {num_calls} ...", file=sys.stderr)
    children = [gateway, floor]
    try:
        for child in children:
            child.start()
        Fleet.wait_serving(children, [gateway_target, floor_target], timeout_s=30)
        return asyncio.run(measure(gateway_target, floor_target, num_calls))
    finally:
        for child in children:
            child.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-refusing", required=True, metavar="HOST:PORT")
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # the gateway's event loop
        runner.run(serve_refusing(parser.parse_args().serve_refusing))
