"""deploy/k8s's Redis users: the gateway's from its Secret, and one user per worker pod whose
password its init container derives from the worker key (gateway/redis_acl.py). The Redis
pod's and a worker pod's init commands run here, against a real Redis 7 (offline: the
manifests come from tests/k8s_render.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.redis_server import EmbeddedRedis
from protos.keys import Keys
from tests.acl_factories import NO_REDIS7, find_redis7
from tests.k8s_render import DEPLOY, OVERLAYS, RENDERED, ROOT, container, env_of, find, worker_sets


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_reaches_redis_as_its_own_acl_user(overlay: str) -> None:
    docs = RENDERED[overlay]
    acl = (DEPLOY / "redis" / "users.acl").read_text()
    assert find(docs, "ConfigMap", "tokenrelay-redis-acl")["data"]["users.acl"] == acl
    secret = find(docs, "Secret", "tokenrelay-redis-credentials")["stringData"]
    env = env_of(container(docs, "tokenrelay-gateway"))
    assert env["REDIS_URL"].startswith("rediss://gateway:$(REDIS_PASSWORD)@redis:6379/0?")
    names = [e["name"] for e in container(docs, "tokenrelay-gateway")["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")  # $(VAR) needs it defined first
    assert env["REDIS_PASSWORD"]["secretKeyRef"]["key"] == "gateway-password"
    redis_pod = find(docs, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]
    init = " ".join(redis_pod["initContainers"][0]["command"])
    for placeholder in re.findall(r">(CHANGE-ME-\S+)", acl):
        if "worker" in placeholder:  # the shared worker user is left out: one user per pod instead
            continue
        assert f">{placeholder}|" in init  # every other placeholder is replaced at pod start
        assert placeholder in secret.values()  # and the Secret's default is that placeholder
    assert '"/^user worker /d"' in init
    args = redis_pod["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert "--aclfile" in args


def init_env(docs: list[dict[str, Any]], pod: dict[str, Any], name: str) -> dict[str, str]:
    """What an init container's environment holds, its Secret references resolved."""
    (init,) = [c for c in pod["initContainers"] if c["name"] == name]
    env = {}
    for e in init["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = find(docs, "Secret", ref["name"])["stringData"][ref["key"]]
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_pod_the_autoscaler_may_start_logs_in_as_its_own_redis_user(
        overlay: str, tmp_path: Path) -> None:
    """The Redis pod's init container writes users.acl; each worker pod's derives its password,
    and its command builds REDIS_URL with it. Both init commands run here (sh, the `tokenrelay`
    CLI) against a real Redis 7 with that file: the last pod the ScaledObject allows of every
    worker StatefulSet logs in, and may not write another pod's heartbeat."""
    redis7 = find_redis7()
    if redis7 is None:
        pytest.skip(NO_REDIS7)
    docs = RENDERED[overlay]
    redis_pod = find(docs, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]
    (acl_init,) = [c for c in redis_pod["initContainers"] if c["name"] == "acl"]
    template, out = tmp_path / "acl-template", tmp_path / "acl"
    template.mkdir()
    out.mkdir()
    (template / "users.acl").write_text((DEPLOY / "redis" / "users.acl").read_text())
    script = acl_init["command"][2].replace("/acl-template/", f"{template}/").replace("/acl/", f"{out}/")
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
           **init_env(docs, redis_pod, "acl")}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=60)
    users = (out / "users.acl").read_text()
    assert "user worker " not in users  # no password all workers share
    sets = dict(s.split("=") for s in env["WORKER_STATEFULSETS"].split())
    assert sorted(sets) == worker_sets(docs)
    with EmbeddedRedis(binary=redis7, extra_args=("--aclfile", str(out / "users.acl"))) as server:
        for name, count in sets.items():
            scaled = next(d for d in docs if d["kind"] == "ScaledObject"
                          and d["spec"]["scaleTargetRef"]["name"] == name)
            assert int(count) >= scaled["spec"]["maxReplicaCount"]  # a user for every pod it may start
            pod_name = f"{name}-{scaled['spec']['maxReplicaCount'] - 1}"
            pod = find(docs, "StatefulSet", name)["spec"]["template"]["spec"]
            (derive,) = [c for c in pod["initContainers"] if c["name"] == "redis-password"]
            password_dir = tmp_path / pod_name
            password_dir.mkdir()
            derive_env = {**env, **init_env(docs, pod, "redis-password"), "POD_NAME": pod_name}
            subprocess.run(["sh", "-c", derive["command"][2].replace("/run/redis-auth/", f"{password_dir}/")],
                           env=derive_env, check=True, timeout=60)
            worker_command = pod["containers"][0]["command"][2]
            url = re.search(r'REDIS_URL="rediss://([^"]+)@', worker_command).group(1)  # type: ignore[union-attr]
            user = url.split(":")[0].replace("$POD_NAME", pod_name)
            password = (password_dir / "password").read_text().strip()
            client = redis.Redis(host="127.0.0.1", port=server.port, username=user, password=password)
            keys = Keys("tokenrelay")
            client.hset(keys.worker(f"{pod_name}.abc123"), "model", "m")  # its own heartbeat
            with pytest.raises(redis.exceptions.ResponseError, match="(?i)noperm|no permissions"):
                client.hset(keys.worker(f"{name}-0.abc123"), "model", "m")  # another pod's
            client.close()
