"""deploy/k8s (kustomize base + cpu/gpu overlays), offline: each overlay renders, core kinds pass
kubernetes-validate (strict, Kubernetes VALIDATE_VERSION), KEDA's ScaledObject and
TriggerAuthentication and the ServiceMonitor pass check-jsonschema against the CRD schemas
vendored in deploy/k8s/schemas, every YAML under deploy/ passes yamllint (deploy/.yamllint), and
the manifests agree with the code: stream and group names, drain timeout vs grace period, the
ACL users and their Secret, lagCount vs max_num_seqs.

Rendering: `kubectl kustomize` when kubectl is installed, else `render` below (resources,
configMapGenerator, strategic-merge patches by kind and name, labels, namespace: what these
kustomizations use); where kubectl exists both are compared.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from protos.keys import Keys

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = ("cpu", "gpu")
VALIDATE_VERSION = "1.30.0"
CRD_SCHEMAS = {"ScaledObject": "scaledobject_v1alpha1.json",
               "TriggerAuthentication": "triggerauthentication_v1alpha1.json",
               "ServiceMonitor": "servicemonitor_v1.json"}
# The redis-streams trigger's metadata keys (keda.sh/docs/2.11+/scalers/redis-streams).
REDIS_STREAMS_KEYS = {"address", "host", "port", "username", "usernameFromEnv", "passwordFromEnv",
                      "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
                      "activationLagCount", "databaseIndex", "enableTLS", "unsafeSsl"}
CLUSTER_SCOPED = {"Namespace"}


# -- a small kustomize -----------------------------------------------------------------------------

def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge as these patches need it: maps merge, lists of named maps merge by name
    (in place, new ones appended), other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out_list = [copy.deepcopy(x) for x in base]
        names = [x["name"] for x in out_list]
        for item in patch:
            if item["name"] in names:
                i = names.index(item["name"])
                out_list[i] = _merge(out_list[i], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources `kubectl kustomize directory` prints (see the module docstring for the subset)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for generator in kustomization.get("configMapGenerator", []):
        assert kustomization["generatorOptions"]["disableNameSuffixHash"], "no hash suffixes rendered here"
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                     "data": data})
    for patch in kustomization.get("patches", []):
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                  (body["kind"], body["metadata"]["name"])]
        assert len(target) == 1, f"patch {patch['path']} matches {len(target)} resources"
        docs[target[0]] = _merge(docs[target[0]], body)
    for label in kustomization.get("labels", []):
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
    return docs


def kubectl_render(directory: Path) -> list[dict[str, Any]] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _normal(value: Any) -> Any:
    """Lists of named maps in name order (kustomize moves patched entries first)."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_normal(v) for v in value]
        if items and all(isinstance(x, dict) and "name" in x for x in items):
            items.sort(key=lambda x: x["name"])
        return items
    return value


def _by_id(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): _normal(d) for d in docs}


RENDERED = {name: render(K8S / "overlays" / name) for name in OVERLAYS}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(docs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    return find(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# -- rendering and schemas ---------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_python_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    rendered = kubectl_render(K8S / "overlays" / overlay)
    if rendered is None:
        pytest.skip("kubectl is not installed: the Python renderer alone renders the overlays")
    assert _by_id(render(K8S / "overlays" / overlay)) == _by_id(rendered)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_kinds_pass_kubernetes_validate_strict(overlay: str) -> None:
    docs = [d for d in RENDERED[overlay] if d["kind"] not in CRD_SCHEMAS]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget",
                                         "Secret", "ConfigMap", "Namespace"}
    for doc in docs:
        kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)


def test_crd_kinds_pass_check_jsonschema_against_the_vendored_crd_schemas(tmp_path: Path) -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    for kind, schema in CRD_SCHEMAS.items():
        files = []
        for overlay, docs in RENDERED.items():
            for doc in docs:
                if doc["kind"] == kind:
                    files.append(tmp_path / f"{overlay}-{kind}-{doc['metadata']['name']}.json")
                    files[-1].write_text(json.dumps(doc))
        assert len(files) == len(OVERLAYS), kind
        out = subprocess.run([str(checker), "--schemafile", str(SCHEMAS / schema), *map(str, files)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_vendored_schemas_reject_a_misspelt_field(tmp_path: Path) -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    scaled = copy.deepcopy(find(RENDERED["cpu"], "ScaledObject", "tokenrelay-worker"))
    scaled["spec"]["maxReplicas"] = 3  # maxReplicaCount
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(scaled))
    out = subprocess.run([str(checker), "--schemafile", str(SCHEMAS / CRD_SCHEMAS["ScaledObject"]), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "maxReplicas" in out.stdout + out.stderr


def test_every_yaml_under_deploy_passes_yamllint() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 15
    out = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(DEPLOY / ".yamllint"),
                          *map(str, files)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_file_is_valid() -> None:
    compose = DEPLOY / "compose.yaml"
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=10)
        if probe.returncode == 0:  # `config` needs no daemon
            out = subprocess.run([docker, "compose", "-f", str(compose), "config", "--quiet"],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            return
    # No docker compose: the structure `config` would check for what this file uses.
    spec = yaml.safe_load(compose.read_text())
    assert set(spec) <= {"services", "volumes", "networks", "configs", "secrets", "name"}
    service_keys = {"image", "build", "command", "environment", "ports", "expose", "depends_on", "volumes",
                    "profiles", "stop_grace_period", "mem_limit"}
    for name, service in spec["services"].items():
        assert set(service) <= service_keys, (name, set(service) - service_keys)
        assert "image" in service or "build" in service, name
        assert set(service.get("depends_on", [])) <= set(spec["services"]), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in spec["volumes"], (name, volume)
        for port in service.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", port), (name, port)


# -- the manifests agree with the code ---------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_the_workers_on_the_request_streams_group_lag(overlay: str) -> None:
    docs, keys = RENDERED[overlay], Keys()
    scaled = find(docs, "ScaledObject", "tokenrelay-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "tokenrelay-worker"
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    triggers = scaled["spec"]["triggers"]
    assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(keys.request_streams)  # every class
    service, namespace = find(docs, "Service", "redis")["metadata"], scaled["metadata"]["namespace"]
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and set(meta) <= REDIS_STREAMS_KEYS
        assert meta["consumerGroup"] == keys.group and meta["username"] == "autoscaler"
        # One more replica per worker's worth of waiting requests.
        assert meta["lagCount"] == env_of(container(docs, "tokenrelay-worker"))["TOKENRELAY_MAX_NUM_SEQS"]
        assert int(meta["activationLagCount"]) >= 0
        assert meta["address"] == f"{service['name']}.{namespace}.svc.cluster.local:6379"  # KEDA's namespace
        auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        (ref,) = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "password"
        assert ref["key"] in find(docs, "Secret", ref["name"])["stringData"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_drain_within_their_grace_period(overlay: str) -> None:
    docs = RENDERED[overlay]
    pod = find(docs, "Deployment", "tokenrelay-worker")["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] >= float(env_of(worker)["TOKENRELAY_DRAIN_TIMEOUT_S"]) + 5
    pre_stop = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop and "kill -0 1" in pre_stop  # SIGTERM = drain; wait for the exit


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_probes_grpc_health_and_keeps_one_pod_in_a_disruption(overlay: str) -> None:
    docs = RENDERED[overlay]
    gateway = container(docs, "tokenrelay-gateway")
    port = next(p["containerPort"] for p in gateway["ports"] if p["name"] == "grpc")
    assert gateway["readinessProbe"]["grpc"]["port"] == gateway["livenessProbe"]["grpc"]["port"] == port
    pdb = find(docs, "PodDisruptionBudget", "tokenrelay-gateway")["spec"]
    assert pdb["minAvailable"] >= 1
    deployment = find(docs, "Deployment", "tokenrelay-gateway")
    assert pdb["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_reaches_redis_as_its_own_acl_user(overlay: str) -> None:
    docs = RENDERED[overlay]
    acl = (DEPLOY / "redis" / "users.acl").read_text()
    assert find(docs, "ConfigMap", "tokenrelay-redis-acl")["data"]["users.acl"] == acl
    secret = find(docs, "Secret", "tokenrelay-redis-credentials")["stringData"]
    for deployment, user in (("tokenrelay-gateway", "gateway"), ("tokenrelay-worker", "worker")):
        env = env_of(container(docs, deployment))
        assert env["REDIS_URL"] == f"redis://{user}:$(REDIS_PASSWORD)@redis:6379/0"
        names = [e["name"] for e in container(docs, deployment)["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")  # $(VAR) needs it defined first
        assert env["REDIS_PASSWORD"]["secretKeyRef"]["key"] == f"{user}-password"
    redis_pod = find(docs, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]
    init = " ".join(redis_pod["initContainers"][0]["command"])
    for placeholder in re.findall(r">(CHANGE-ME-\S+)", acl):
        assert f">{placeholder}|" in init  # every placeholder is replaced at pod start
        assert placeholder in secret.values()  # and the Secret's default is that placeholder
    args = redis_pod["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert "--aclfile" in args


def test_the_gpu_overlay_asks_for_one_gpu_and_runs_on_cuda() -> None:
    pod = find(RENDERED["gpu"], "Deployment", "tokenrelay-worker")["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["args"][worker["args"].index("--device") + 1] == "cuda"
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    cpu = container(RENDERED["cpu"], "tokenrelay-worker")
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert "--device" not in cpu.get("args", [])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_monitor_scrapes_gateway_and_worker_metrics_ports(overlay: str) -> None:
    docs = RENDERED[overlay]
    monitor = find(docs, "ServiceMonitor", "tokenrelay")["spec"]
    (expression,) = monitor["selector"]["matchExpressions"]
    ports: set[int] = set()
    for service in (d for d in docs if d["kind"] == "Service"):
        if service["metadata"].get("labels", {}).get(expression["key"]) in expression["values"]:
            port_name = monitor["endpoints"][0]["port"]
            ports |= {p["port"] for p in service["spec"]["ports"] if p["name"] == port_name}
    assert ports == {9400, 9401}


# -- Redis memory: bounded, never evicted -------------------------------------------------------------

# Byte multipliers of the suffixes used: Redis's (1mb = 1024*1024, 1m = 10**6), Kubernetes' quantities
# and docker's mem_limit (1g = 1024**3).
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kb": 1024, "mb": 1024**2, "gb": 1024**3,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3}
DOCKER_UNITS = {"b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def to_bytes(size: str, units: dict[str, int] = _UNITS) -> int:
    number, unit = re.fullmatch(r"(\d+)([a-zA-Z]*)", str(size)).groups()  # type: ignore[union-attr]
    return int(number) * units[unit.lower()]


def redis_servers() -> list[tuple[str, list[str], int]]:
    """(where, redis-server arguments, memory limit in bytes) of every Redis under deploy/: the
    compose service and each overlay's StatefulSet container (not the ACL init container)."""
    servers = []
    for name, service in yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"].items():
        if service.get("image", "").startswith("redis") and service["command"][0] == "redis-server":
            servers.append((f"compose {name}", service["command"][1:], to_bytes(service["mem_limit"],
                                                                                 DOCKER_UNITS)))
    for overlay, docs in RENDERED.items():
        for doc in docs:
            if doc["kind"] in ("StatefulSet", "Deployment"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if c["image"].startswith("redis"):  # the image's entrypoint runs redis-server
                        servers.append((f"{overlay} {doc['metadata']['name']}", c["args"],
                                        to_bytes(c["resources"]["limits"]["memory"])))
    return servers


def test_every_redis_in_deploy_bounds_its_memory_and_never_evicts() -> None:
    servers = redis_servers()
    assert len(servers) == 1 + len(OVERLAYS)
    for where, args, limit in servers:
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction", where
        maxmemory = to_bytes(args[args.index("--maxmemory") + 1])
        # headroom for fragmentation, client buffers and the AOF rewrite's fork
        assert 0 < maxmemory <= limit - 128 * 1024**2, (where, maxmemory, limit)
