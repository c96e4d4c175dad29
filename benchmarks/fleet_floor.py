"""The gRPC floor of benchmarks/fleet.py: what one streamed message costs grpc.aio itself.

A no-op grpc.aio server (on the gateway's event loop, `--event-loop auto`) holds S
server-streaming calls and sends each one small chunk per
simulated step, woken in W groups as W workers' rounds wake a gateway's calls, with no
Redis and no relay: the server's CPU seconds per 1,000 messages is the least a Python
gateway that sends one message per token can cost on this machine, now. The fleet's
gateways send exactly one message per token, so their CPU per 1,000 tokens over this floor
is tokenrelay's own share.

    python benchmarks/fleet_floor.py --serve HOST:PORT --streams S --workers W --step-ms MS
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from benchmarks.fleet_procs import Child, Fleet, proc_cpu_s  # noqa: E402
from gateway.__main__ import loop_factory  # noqa: E402
from gateway.redis_server import free_port  # noqa: E402
from protos.convert import build_request  # noqa: E402
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402

REQUEST_ID = "0123456789abcdef0123456789abcdef"  # as long as a generated request id


class StreamingServicer(generate_pb2_grpc.TokenRelayServicer):
    """Every call gets one chunk per round of its group; call k is in group k % W."""

    def __init__(self, num_groups: int, step_s: float) -> None:
        self.num_groups, self.step_s = num_groups, step_s
        self.rounds = [asyncio.Event() for _ in range(num_groups)]
        self.num_calls = 0

    async def tick(self) -> None:
        """Wake one group every step / W, as W workers with staggered rounds would."""
        group = 0
        while True:
            await asyncio.sleep(self.step_s / self.num_groups)
            event, self.rounds[group] = self.rounds[group], asyncio.Event()
            event.set()
            group = (group + 1) % self.num_groups

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        group = self.num_calls % self.num_groups
        self.num_calls += 1
        for index in range(1 << 30):
            await self.rounds[group].wait()
            chunk = generate_pb2.Chunk(index=index, token_ids=[1234], text=" tok")
            yield generate_pb2.GenerateResponse(request_id=REQUEST_ID, chunk=chunk)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:  # noqa: N802 (serving probe)
        return generate_pb2.ServerInfo()


async def serve(target: str, num_streams: int, num_groups: int, step_ms: float) -> None:
    servicer = StreamingServicer(num_groups, step_ms / 1000)
    server = grpc.aio.server()
    generate_pb2_grpc.add_TokenRelayServicer_to_server(servicer, server)
    server.add_insecure_port(target)
    await server.start()
    ticker = asyncio.ensure_future(servicer.tick())
    await server.wait_for_termination()
    ticker.cancel()


async def _measure(target: str, pid: int, num_streams: int, warmup_s: float,
                   window_s: float) -> dict[str, Any]:
    counted = 0

    async def stream(stub: Any) -> None:
        nonlocal counted
        async for _ in stub.Generate(build_request("floor", max_tokens=1)):
            counted += 1

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TokenRelayStub(channel)
        tasks = [asyncio.ensure_future(stream(stub)) for _ in range(num_streams)]
        await asyncio.sleep(warmup_s)
        cpu, messages, start = proc_cpu_s(pid), counted, time.perf_counter()
        await asyncio.sleep(window_s)
        cpu, messages = proc_cpu_s(pid) - cpu, counted - messages
        elapsed = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": num_streams, "messages_per_s": messages / elapsed,
            "cpu_s_per_1k_messages": 1000 * cpu / messages if messages else None}


def grpc_floor(log_dir: Path, num_streams: int, num_workers: int, step_ms: float, *, warmup_s: float,
               window_s: float) -> dict[str, Any]:
    """The floor server's CPU per 1,000 messages at the fleet point's streams and token rate."""
    target = f"127.0.0.1:{free_port()}"
    server = Child("grpc-floor", [__file__, "--serve", target, "--streams", str(num_streams),
                                  "--workers", str(num_workers), "--step-ms", str(step_ms)],
                   log_dir / "grpc-floor.log")
    print(f"gRPC floor: a no-op server streaming to {num_streams} calls ...", file=sys.stderr)
    try:
        server.start()
        Fleet.wait_serving([server], [target], timeout_s=30)
        assert server.proc is not None
        return asyncio.run(_measure(target, server.proc.pid, num_streams, warmup_s, window_s))
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", required=True, metavar="HOST:PORT")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--step-ms", type=float, required=True)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # the gateway's event loop
        runner.run(serve(args.serve, args.streams, args.workers, args.step_ms))
