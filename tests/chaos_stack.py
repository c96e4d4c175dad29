"""The processes of the chaos harness (tests/chaos.py): Redis with AOF, gateways and
workers as child processes that can be killed and started again in their slots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from gateway.redis_server import EmbeddedRedis, free_port
from protos.keys import Keys
from tests.service import ROOT, is_serving, stub_for, wait_until, workers_ready

# Small batches and one torch thread each: 3 workers share 2 cores. A 2 s heartbeat TTL lets
# a killed worker's requests be queued again soon; 3 s of drain keeps a SIGTERM short.
WORKER_ARGS = ("--max-num-seqs", "8", "--max-model-len", "256", "--heartbeat-ttl", "2",
               "--drain-timeout", "3", "--reattach-grace", "10", "--num-threads", "1")
GATEWAY_ARGS = ("--shutdown-grace", "2", "--max-redis-outage", "30", "--worker-heartbeat-ttl", "2")
# Metrics off, or every process would want the same default port (an env var: a version
# without metrics ignores it).
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENRELAY_METRICS_PORT": "0"}
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this (> the workers' drain timeout)


class Child:
    """A process slot (`python -m gateway` or `worker`) that restarts under the same port and
    log file; every other restart keeps the id (as a StatefulSet pod does: the new process
    must take back what the old one left pending), the others take a new one."""

    def __init__(self, name: str, family: str, args: list[str], log_path: Path, port: int = 0) -> None:
        self.name, self.family, self.args, self.log_path, self.port = name, family, args, log_path, port
        self.generation = -1
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "down"  # down -> starting -> up -> stopping -> down
        self.restart_at = self.stop_deadline = 0.0

    @property
    def instance_id(self) -> str:
        return f"{self.name}-g{self.generation // 2}"

    def start(self) -> None:
        self.generation += 1
        args = [sys.executable, "-m", self.family, *self.args, f"--{self.family}-id", self.instance_id]
        if self.port:
            args += ["--listen", f"127.0.0.1:{self.port}"]
        with open(self.log_path, "ab") as log:
            log.write(f"=== chaos: start {self.instance_id} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=CHILD_ENV)
        self.state = "starting"

    def send(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.state, self.stop_deadline = "stopping", time.monotonic() + STOP_TIMEOUT_S

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.state = "down"


class Stack:
    """Redis with AOF in a data_dir that survives kill()+start(), the gateways and the workers."""

    def __init__(self, num_gateways: int, num_workers: int, work_dir: Path) -> None:
        self.redis = EmbeddedRedis(data_dir=work_dir / "redis")
        self.keys = Keys(f"chaos-{uuid.uuid4().hex[:8]}")
        common = ["--redis-url", self.redis.url, "--key-prefix", self.keys.prefix, "--log-level", "INFO"]
        self.gateways = [Child(f"gateway-{i}", "gateway", [*common, *GATEWAY_ARGS],
                               work_dir / f"gateway-{i}.log", port=free_port())
                         for i in range(num_gateways)]
        self.workers = [Child(f"worker-{i}", "worker", [*common, *WORKER_ARGS], work_dir / f"worker-{i}.log")
                        for i in range(num_workers)]
        self.children = [*self.gateways, *self.workers]
        self.targets = [f"127.0.0.1:{g.port}" for g in self.gateways]

    def start(self, timeout_s: float) -> None:
        """Until every gateway is SERVING and GetServerInfo lists every worker."""
        self.redis.start()
        for child in self.children:
            child.start()

        def is_ready() -> bool:
            if exited := [f"{c.log_path} (exit {c.proc and c.proc.returncode})" for c in self.children
                          if c.exited()]:
                raise RuntimeError(f"stopped during start-up: {', '.join(exited)}")
            return all(self.is_ready(c) for c in self.children)

        channel, stub = stub_for(self.targets[0])
        with channel:
            wait_until(is_ready, timeout=timeout_s, interval=0.5)
            wait_until(workers_ready(stub, len(self.workers)), timeout=timeout_s, interval=0.5)
        for child in self.children:
            child.state = "up"

    def is_ready(self, child: Child) -> bool:
        """A gateway answers SERVING; a worker is in the registry (its model is loaded; its consumer
        is ``{worker_id}.{incarnation}``, a new one per process)."""
        if child.family == "gateway":
            return is_serving(f"127.0.0.1:{child.port}")
        client = redis.Redis.from_url(self.redis.url, socket_timeout=1)
        try:
            names = client.zrangebyscore(self.keys.registry, time.time() * 1000, "+inf")
            return any(name.decode().startswith(f"{child.instance_id}.") for name in names)
        except redis.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM every child (they drain at once), SIGKILL what is left, Redis last."""
        for child in self.children:
            if not child.exited():
                child.send(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            child.wait_or_kill(deadline)
        self.redis.stop()
