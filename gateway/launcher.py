"""Start and stop a whole tokenrelay stack as child processes.

Redis (embedded unless a URL is given) + one gateway + N workers. Children run
in their own sessions so a Ctrl-C in the terminal reaches only the launcher,
which then shuts everything down in order: gateway and workers get SIGTERM
(they drain), stragglers get SIGKILL, the embedded Redis goes last.

A listen port of 0 lets the gateway bind any free port and print it (its first line on
stdout), which the launcher reads: choosing a free port and handing it to a child lost
the port now and then to another process's connection in between (a failed `make test`).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.redis_server import EmbeddedRedis
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc


@dataclass
class StackConfig:
    listen: str = "127.0.0.1:50051"
    redis_url: str | None = None  # None = start an embedded Redis
    num_workers: int = 1
    worker_args: list[str] = field(default_factory=list)  # passed to every `python -m worker`
    gateway_args: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    # Prometheus ports: the gateway on this one, worker i on this + 1 + i; 0 = metrics off.
    metrics_port: int = 0
    stop_timeout_s: float = 40.0  # > the worker's default drain timeout

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.num_workers}")


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url or ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._port = config.listen.rpartition(":")[2]  # "0" until the gateway said which
        self._port_known = threading.Event()

    @property
    def target(self) -> str:
        """host:port to dial; with listen port 0, valid once wait_ready returned."""
        host = self.config.listen.rpartition(":")[0].replace("0.0.0.0", "127.0.0.1")
        return f"{host}:{self._port}"

    def start(self) -> None:
        if not self.config.redis_url:
            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.start()
        cfg = self.config
        common = ["--redis-url", self.redis_url, "--log-level", cfg.log_level]
        # reflection on: `tokenrelay up` and the demo are for trying the API out (grpcurl)
        self._spawn("gateway", ["gateway", "--listen", cfg.listen, *common, *self._metrics_args(-1),
                                "--reflection", *cfg.gateway_args], stdout=subprocess.PIPE)
        threading.Thread(target=self._read_gateway_stdout, daemon=True).start()
        for i in range(cfg.num_workers):
            self._spawn(f"worker-{i}", ["worker", *common, *self._metrics_args(i), *cfg.worker_args])

    def _metrics_args(self, worker: int) -> list[str]:
        """--metrics-port of the gateway (worker -1) or of worker i: one port each, or all off."""
        base = self.config.metrics_port
        return ["--metrics-port", str(base + 1 + worker if base else 0)]

    def _spawn(self, name: str, args: list[str], stdout: int | None = None) -> None:
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *args], start_new_session=True,
                                            stdout=stdout)

    def _read_gateway_stdout(self) -> None:
        """Take the bound port from "... listening on host:port" and pass every line on."""
        out = self.procs["gateway"].stdout
        assert out is not None
        for raw in out:
            line = raw.decode(errors="replace")
            found = re.search(r"listening on \S*:(\d+)", line)
            if found and not self._port_known.is_set():
                self._port = found.group(1)
                self._port_known.set()
            sys.stdout.write(line)
            sys.stdout.flush()

    def exited(self) -> list[str]:
        """'name (exit code)' of every child that is no longer running."""
        return [f"{name} (exit {p.returncode})" for name, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, timeout_s: float = 300.0) -> generate_pb2.ServerInfo:
        """Until the gateway is SERVING and every worker has a heartbeat (model loaded)."""
        deadline = time.monotonic() + timeout_s
        while not self._port_known.wait(0.2):
            if self.exited():
                raise RuntimeError(f"stopped during start-up: {', '.join(self.exited())}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not listen within {timeout_s:.0f}s")
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = generate_pb2_grpc.TokenRelayStub(channel)
            while time.monotonic() < deadline:
                if self.exited():
                    raise RuntimeError(f"stopped during start-up: {', '.join(self.exited())}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    info = stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=1)
                    if status == health_pb2.HealthCheckResponse.SERVING and \
                            len(info.workers) >= self.config.num_workers:
                        return info
                except grpc.RpcError:
                    pass  # not listening yet
                time.sleep(0.2)  # children report readiness only through the gateway
        raise TimeoutError(f"the stack was not ready within {timeout_s:.0f}s")

    def wait(self) -> None:
        """Block until a child exits or SIGINT/SIGTERM arrives."""
        signals = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            while not self.exited():
                if signal.sigwaitinfo(signals).si_signo != signal.SIGCHLD:
                    return
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def stop(self) -> None:
        """SIGTERM gateway and workers (they drain), SIGKILL what is left, then stop Redis."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
