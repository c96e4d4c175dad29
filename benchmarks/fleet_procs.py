"""The child processes of benchmarks/fleet.py (gateways and sim workers) and routing.py
(a gateway and model workers), each with its own log file, its CPU time from /proc, and a
clean stop (SIGTERM, then SIGKILL).

Children run in their own session, so a Ctrl-C in the terminal reaches only the bench,
which stops them in its `finally`; an atexit hook kills whatever is still running if the
bench dies some other way.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from gateway.redis_server import free_port
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENRELAY_METRICS_PORT": "0"}
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 15
# What a sim worker serves (--served-model-name's default): the gateways queue for it even before a
# worker heart-beats (--models), as a deployment declares its models.
SIM_MODEL = "sim"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

_running: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_running):
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat; 0 once it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = data[data.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ChildDied(RuntimeError):
    pass


class Child:
    """`python ARGV...` (`-m gateway ...`, `-m worker ...`) with its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, *self.argv], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV,
                                         start_new_session=True)
        _running.add(self.proc)

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def died(self) -> ChildDied:
        code = self.proc.returncode if self.proc is not None else None
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            lines = []
        tail = "\n    ".join(lines) or "(no output)"
        return ChildDied(f"{self.name} exited with {code}; its last lines ({self.log_path}):\n    {tail}")

    def signal(self, sig: signal.Signals) -> None:
        if self.is_alive and self.proc is not None:
            self.proc.send_signal(sig)

    def wait(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _running.discard(self.proc)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        self.wait(time.monotonic() + STOP_TIMEOUT_S)


class ChildGroup:
    """Gateways serving on `targets` and workers: started together, serving once every gateway
    answers and lists every worker, stopped together."""

    def __init__(self, gateways: list[Child], targets: list[str], workers: list[Child]) -> None:
        self.gateways, self.targets, self.workers = gateways, targets, workers
        self.children = [*gateways, *workers]

    def start(self, timeout_s: float) -> None:
        """Until every gateway answers and the registry lists every worker."""
        for child in self.children:
            child.start()
        self.wait_serving(self.children, self.targets, timeout_s, num_workers=len(self.workers))

    @staticmethod
    def wait_serving(children: list[Child], targets: list[str], timeout_s: float,
                     num_workers: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(targets)
        while pending:
            for child in children:
                if not child.is_alive:
                    raise child.died()
            if time.monotonic() > deadline:
                raise ChildDied(f"not serving within {timeout_s:.0f}s: {', '.join(pending)}")
            if _num_workers(pending[0]) >= num_workers:
                pending.pop(0)
            else:
                time.sleep(0.2)  # processes starting: nothing to wait on but their port

    def check(self) -> None:
        """ChildDied (with its last log lines) if any child has exited."""
        for child in self.children:
            if not child.is_alive:
                raise child.died()

    def cpu_s(self, children: list[Child]) -> float:
        return sum(c.cpu_s() for c in children)

    def stop(self) -> None:
        """SIGTERM to all (they drain in parallel), then wait; SIGKILL what is left."""
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            child.wait(deadline)


class Fleet(ChildGroup):
    """G gateways on free loopback ports and W sim workers, on one key prefix."""

    def __init__(self, redis_url: str, prefix: str, log_dir: Path, *, num_gateways: int, num_workers: int,
                 max_num_seqs: int, max_queue_depth: int, step_ms: float, max_model_len: int) -> None:
        common = ["--redis-url", redis_url, "--key-prefix", prefix, "--metrics-port", "0",
                  "--log-level", "WARNING"]
        ports = [free_port() for _ in range(num_gateways)]
        targets = [f"127.0.0.1:{p}" for p in ports]
        gateways = [Child(f"gateway-{i}",
                          ["-m", "gateway", "--listen", t, "--max-queue-depth", str(max_queue_depth),
                           "--models", SIM_MODEL, "--shutdown-grace", "1", *common],
                          log_dir / f"gateway-{i}.log")
                    for i, t in enumerate(targets)]
        workers = [Child(f"worker-{i}",
                         ["-m", "worker", "--engine", "sim", "--sim-step-ms", f"{step_ms:.3f}",
                          "--sim-ms-per-token", "0",
                          "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                          "--drain-timeout", "1", "--reattach-grace", "1",
                          "--worker-id", f"{prefix}-w{i}", *common], log_dir / f"worker-{i}.log")
                   for i in range(num_workers)]
        super().__init__(gateways, targets, workers)


def _num_workers(target: str) -> int:
    """Workers the gateway at `target` lists; -1 while it does not answer."""
    with grpc.insecure_channel(target) as channel:
        try:
            info = generate_pb2_grpc.TokenRelayStub(channel).GetServerInfo(
                generate_pb2.GetServerInfoRequest(), timeout=1)
        except grpc.RpcError:
            return -1
    return len(info.workers)

