"""Passwords never reach a log line or an error message: redact_url, then real processes
started with a password in their Redis URL, every log line of theirs grepped."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from gateway.redis_server import free_port
from protos.convert import build_request
from protos.redis_conn import check_redis_url, redact_url
from tests.service import ROOT, stub_for, wait_until, workers_ready

PASSWORD = "s3cret-" + uuid.uuid4().hex


@pytest.mark.parametrize(("url", "shown"), [
    (f"redis://:{PASSWORD}@h:1/0", "redis://:***@h:1/0"),
    (f"redis://user:{PASSWORD}@h/0", "redis://user:***@h/0"),
    (f"rediss://u:{PASSWORD}@h:6379/0?ssl_ca_certs=/ca.crt", "rediss://u:***@h:6379/0?ssl_ca_certs=/ca.crt"),
    (f"redis+sentinel://:{PASSWORD}@a:1,b:2/svc/0", "redis+sentinel://:***@a:1,b:2/svc/0"),
    (f"unix:///tmp/r.sock?db=1&password={PASSWORD}", "unix:///tmp/r.sock?db=1&password=***"),
    ("redis://h:1/0", "redis://h:1/0"),
])
def test_redact_url_hides_the_password_and_nothing_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [f"http://u:{PASSWORD}@h/0", f"redis+sentinel://:{PASSWORD}@a:1/",
                                 f"redis+sentinel://:{PASSWORD}@a:99999/svc"])
def test_a_bad_url_is_refused_without_echoing_its_password(url: str) -> None:
    with pytest.raises(ValueError) as e:
        check_redis_url(url)
    assert PASSWORD not in str(e.value) and "***" in str(e.value)


@pytest.fixture
def password_url(redis_url: str) -> Iterator[str]:
    """The test Redis through an ACL user of its own whose password is PASSWORD."""
    user = f"secret-test-{uuid.uuid4().hex[:6]}"
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(user, enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"], channels=["*"],
                      commands=["+@all"])
    parts = urlsplit(redis_url)
    yield f"redis://{user}:{PASSWORD}@{parts.hostname}:{parts.port}{parts.path}"
    admin.acl_deluser(user)
    admin.close()


def _spawn(module: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", module, "--log-level", "DEBUG", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)


def test_no_log_line_of_a_gateway_or_worker_shows_the_redis_password(
        tmp_path: Path, password_url: str, prefix: str) -> None:
    """A gateway and a worker with the password in their URL serve a call at DEBUG level; a
    gateway whose Redis is unreachable warns; a bad URL is refused. None prints the password."""
    target = f"127.0.0.1:{free_port()}"
    unreachable = f"redis://u:{PASSWORD}@127.0.0.1:{free_port()}/0"
    common = ["--key-prefix", prefix, "--metrics-port", "0"]
    procs = {
        "gateway": _spawn("gateway", tmp_path / "gateway.log", "--listen", target,
                          "--redis-url", password_url, *common),
        "worker": _spawn("worker", tmp_path / "worker.log", "--redis-url", password_url, "--engine", "sim",
                         "--sim-step-ms", "5", *common),
        "lost": _spawn("gateway", tmp_path / "lost.log", "--listen", f"127.0.0.1:{free_port()}",
                       "--redis-url", unreachable, *common),
    }
    bad = subprocess.run([sys.executable, "-m", "gateway", "--redis-url", f"http://u:{PASSWORD}@h/0"],
                         cwd=ROOT, capture_output=True, timeout=60)
    try:
        channel, stub = stub_for(target)
        wait_until(workers_ready(stub, 1), timeout=60, interval=0.2)
        responses = list(stub.Generate(build_request("hi", max_tokens=4, request_id="secret-1"), timeout=30))
        assert responses[-1].HasField("final")
        wait_until(lambda: "not reachable" in (tmp_path / "lost.log").read_text(), timeout=30, interval=0.2)
        channel.close()
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    assert bad.returncode == 2 and b"***" in bad.stderr and PASSWORD.encode() not in bad.stderr
    for name in procs:
        text = (tmp_path / f"{name}.log").read_text()
        assert text, f"{name} logged nothing: the test would prove nothing"
        assert PASSWORD not in text, f"{name} logged the Redis password"
    assert "***" in (tmp_path / "lost.log").read_text()
