"""The load generator of benchmarks/fleet.py: S grpc.aio streams kept open over the gateways (a
finished request is followed at once by the next), each token checked against the sim engine's
`sim_token_ids(seed, i, 1)`, with the chunk timings the benchmark's ITL and TTFT come from."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import grpc

from benchmarks.fleet_stats import Errors, StreamCheck
from protos.convert import build_request
from worker.engine.sim import sim_text, sim_token_ids

PROMPT = "fleet"  # 2 prompt tokens in the sim engine


class Load:
    """S streams kept open over the gateways; chunk timings and token checks."""

    def __init__(self, stubs: list[Any], num_streams: int, output_len: int, seed_base: int,
                 call_timeout_s: float, stream_interval: int = 1) -> None:
        self.stubs, self.num_streams, self.output_len = stubs, num_streams, output_len
        self.stream_interval = stream_interval  # > 1: a chunk's gap is that many steps, no ITL kept
        self.seed_base, self.call_timeout_s = seed_base, call_timeout_s
        self.is_stopping = self.is_measuring = False
        self.window_start = math.inf
        self.num_tokens = 0  # tokens that arrived while measuring
        self.gaps_s: list[float] = []
        self.ttfts_s: list[float] = []
        self.errors = Errors()
        self.opened: set[int] = set()  # slots whose first stream has had its first chunk
        self.num_refused = 0
        self.last_refusal = ""

    async def slot(self, slot: int) -> None:
        stub = self.stubs[slot % len(self.stubs)]
        for n in range(1 << 20):
            if self.is_stopping:
                return
            seed = self.seed_base + (slot << 20) + n
            check = StreamCheck(seed, sim_token_ids, sim_text)
            try:
                await self.stream(stub, slot, check)
            except grpc.aio.AioRpcError as e:
                self.num_refused += 1
                self.last_refusal = f"{e.code().name}: {e.details()}"
                await asyncio.sleep(0.1)
            finally:
                self.errors.add(check)

    async def stream(self, stub: Any, slot: int, check: StreamCheck) -> None:
        request = build_request(PROMPT, max_tokens=self.output_len, seed=check.seed, ignore_eos=True,
                                stream_interval=self.stream_interval if self.stream_interval > 1 else None)
        sent = time.perf_counter()
        last: float | None = None
        async for response in stub.Generate(request, timeout=self.call_timeout_s):
            now = time.perf_counter()
            if not response.HasField("chunk"):
                check.finish(response.final.usage.completion_tokens)
                continue
            chunk = response.chunk
            if self.is_measuring:
                self.num_tokens += len(chunk.token_ids)
                if last is None and sent >= self.window_start:
                    self.ttfts_s.append(now - sent)
                elif last is not None and last >= self.window_start and self.stream_interval == 1:
                    self.gaps_s.append(now - last)
            if last is None:
                self.opened.add(slot)
            last = now
            check.feed(chunk.index, chunk.token_ids, chunk.text)
