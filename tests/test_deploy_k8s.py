"""deploy/k8s (kustomize base + cpu/gpu overlays), offline: each overlay renders, core kinds pass
kubernetes-validate (strict, Kubernetes VALIDATE_VERSION), KEDA's ScaledObject and
TriggerAuthentication, cert-manager's Certificate and Issuer and the ServiceMonitor pass
check-jsonschema against the CRD schemas vendored in deploy/k8s/schemas, every YAML under deploy/
passes yamllint (deploy/.yamllint), and the manifests agree with the code: stream and group
names, drain timeout vs grace period, the ACL users and their Secret, lagCount vs max_num_seqs,
the flags and files the gateway is started with.

Rendering: tests/k8s_render.py. Secure as shipped: tests/test_deploy_k8s_security.py.
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
from tests.k8s_render import (
    DEPLOY,
    K8S,
    OVERLAYS,
    RENDERED,
    SCHEMAS,
    container,
    env_of,
    find,
    gateway_certificate,
    kubectl_render,
    matches,
    mounted_secret_dir,
    redis_certificate,
    render,
)

VALIDATE_VERSION = "1.30.0"
CRD_SCHEMAS = {"ScaledObject": "scaledobject_v1alpha1.json",
               "TriggerAuthentication": "triggerauthentication_v1alpha1.json",
               "ServiceMonitor": "servicemonitor_v1.json",
               "Certificate": "certificate_v1.json",
               "Issuer": "issuer_v1.json"}
# The redis-streams trigger's metadata keys (keda.sh/docs/2.11+/scalers/redis-streams).
REDIS_STREAMS_KEYS = {"address", "host", "port", "username", "usernameFromEnv", "passwordFromEnv",
                      "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
                      "activationLagCount", "databaseIndex", "enableTLS", "unsafeSsl"}


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
                                         "Secret", "ConfigMap", "Namespace", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)


def test_crd_kinds_pass_check_jsonschema_against_the_vendored_crd_schemas(tmp_path: Path) -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    for kind, schema in CRD_SCHEMAS.items():
        files = []
        for overlay, docs in RENDERED.items():
            for doc in docs:
                if doc["kind"] == kind:
                    files.append(tmp_path / f"{overlay}__{kind}-{doc['metadata']['name']}.json")
                    files[-1].write_text(json.dumps(doc))
        assert {f.name.split("__")[0] for f in files} == set(OVERLAYS), kind
        out = subprocess.run([str(checker), "--schemafile", str(SCHEMAS / schema), *map(str, files)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(("kind", "name", "misspelt"), [
    ("ScaledObject", "tokenrelay-worker", "maxReplicas"),  # maxReplicaCount
    ("Certificate", "tokenrelay-redis", "dnsName"),  # dnsNames
    ("Issuer", "tokenrelay-ca", "secretname"),  # under ca: secretName
])
def test_the_vendored_schemas_reject_a_misspelt_field(tmp_path: Path, kind: str, name: str,
                                                      misspelt: str) -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    doc = copy.deepcopy(find(RENDERED["cpu"], kind, name))
    (doc["spec"]["ca"] if kind == "Issuer" else doc["spec"])[misspelt] = "x"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    out = subprocess.run([str(checker), "--schemafile", str(SCHEMAS / CRD_SCHEMAS[kind]), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and misspelt in out.stdout + out.stderr


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

def scaled_models(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """served model -> (its ScaledObject, the worker StatefulSet it scales)."""
    found = {}
    for scaled in (d for d in docs if d["kind"] == "ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")  # stable pod names
        deployment = find(docs, "StatefulSet", target["name"])
        worker_env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
        model = worker_env["TOKENRELAY_SERVED_MODEL_NAME"]
        assert model not in found, f"two ScaledObjects scale workers of {model}"
        found[model] = (scaled, deployment)
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_each_models_workers_on_that_models_streams_group_lag(overlay: str) -> None:
    docs = RENDERED[overlay]
    models = scaled_models(docs)
    assert len(models) == (2 if overlay == "two-models" else 1)
    for model, (scaled, deployment) in models.items():
        keys = Keys("tokenrelay", model)
        assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
        triggers = scaled["spec"]["triggers"]
        streams = sorted(t["metadata"]["stream"] for t in triggers)
        assert streams == sorted(keys.request_streams)  # every class, of its model
        worker_env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
        check_triggers(docs, scaled, keys, worker_env["TOKENRELAY_MAX_NUM_SEQS"])


def test_the_gateway_queues_for_every_scaled_model_and_its_default_is_one() -> None:
    """A model KEDA may scale to zero must be in the gateway's --models, else its requests get
    NOT_FOUND while no worker of it runs; worker Deployments select only their own model's pods."""
    for overlay in OVERLAYS:
        docs = RENDERED[overlay]
        gateway = env_of(container(docs, "tokenrelay-gateway"))
        declared = gateway["TOKENRELAY_MODELS"].split(",")
        assert sorted(declared) == sorted(scaled_models(docs))
        assert gateway["TOKENRELAY_DEFAULT_MODEL"] in declared
        selectors = [d["spec"]["selector"]["matchLabels"] for _, d in scaled_models(docs).values()]
        assert all(s["app"] == "tokenrelay-worker" for s in selectors)  # the NetworkPolicies' label
        assert len({s["tokenrelay.dev/model"] for s in selectors}) == len(selectors)


def check_triggers(docs: list[dict[str, Any]], scaled: dict[str, Any], keys: Keys, max_num_seqs: str) -> None:
    service, namespace = find(docs, "Service", "redis")["metadata"], scaled["metadata"]["namespace"]
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and set(meta) <= REDIS_STREAMS_KEYS
        assert meta["consumerGroup"] == keys.group and meta["username"] == "autoscaler"
        # One more replica per worker's worth of waiting requests.
        assert meta["lagCount"] == max_num_seqs
        assert int(meta["activationLagCount"]) >= 0
        assert meta["address"] == f"{service['name']}.{namespace}.svc.cluster.local:6379"  # KEDA's namespace
        auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
        assert set(refs) == {"password", "tls", "ca"}
        assert refs["password"]["key"] in find(docs, "Secret", refs["password"]["name"])["stringData"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_reaches_redis_over_tls_checking_its_certificate(overlay: str) -> None:
    docs = RENDERED[overlay]
    dns_names = redis_certificate(docs)["dnsNames"]
    triggers = [t for d in docs if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    for trigger in triggers:
        meta = trigger["metadata"]
        # KEDA refuses a trigger with TLS set in both places; the CA is only an auth parameter.
        assert "enableTLS" not in meta and meta.get("unsafeSsl", "false") == "false"
        assert meta["address"].rpartition(":")[0] in dns_names  # the name KEDA checks
        auth = find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
        assert find(docs, "Secret", refs["tls"]["name"])["stringData"][refs["tls"]["key"]] == "enable"
        assert (refs["ca"]["name"], refs["ca"]["key"]) == (redis_certificate(docs)["secretName"], "ca.crt")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_drain_within_their_grace_period(overlay: str) -> None:
    docs = RENDERED[overlay]
    pod = find(docs, "StatefulSet", "tokenrelay-worker")["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] >= float(env_of(worker)["TOKENRELAY_DRAIN_TIMEOUT_S"]) + 5
    pre_stop = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in pre_stop and "kill -0 1" in pre_stop  # SIGTERM = drain; wait for the exit


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_probes_its_tls_port_and_keeps_one_pod_in_a_disruption(overlay: str) -> None:
    docs = RENDERED[overlay]
    gateway = container(docs, "tokenrelay-gateway")
    port = next(p["containerPort"] for p in gateway["ports"] if p["name"] == "grpc")
    tls_dir = mounted_secret_dir(docs, "tokenrelay-gateway", gateway_certificate(docs)["secretName"])
    probe_dir = next(m["mountPath"] for m in gateway["volumeMounts"] if m["name"] == "probe")
    for kind, check in (("readinessProbe", "ready"), ("livenessProbe", "alive")):
        # the kubelet's grpc probe speaks no TLS
        assert gateway[kind]["exec"]["command"] == ["python", "-I", f"{probe_dir}/probe.py", check, str(port),
                                                    tls_dir]
    probe = find(docs, "ConfigMap", "tokenrelay-gateway-probe")["data"]["probe.py"]
    server_name = re.search(r'SERVER_NAME = "(.+)"', probe).group(1)  # type: ignore[union-attr]
    assert server_name in gateway_certificate(docs)["dnsNames"]  # the name probe.py checks
    pdb = find(docs, "PodDisruptionBudget", "tokenrelay-gateway")["spec"]
    assert pdb["minAvailable"] >= 1
    deployment = find(docs, "Deployment", "tokenrelay-gateway")
    assert pdb["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_the_gpu_overlay_asks_for_one_gpu_and_runs_on_cuda() -> None:
    pod = find(RENDERED["gpu"], "StatefulSet", "tokenrelay-worker")["spec"]["template"]["spec"]
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
    assert set(monitor["selector"]) == {"matchLabels"}
    selected = [d for d in docs if d["kind"] == "Service" and matches(monitor["selector"], d["metadata"])]
    assert sorted(d["metadata"]["name"] for d in selected) == ["tokenrelay-gateway-metrics",
                                                               "tokenrelay-worker-metrics"]
    (endpoint,) = monitor["endpoints"]
    ports = {p["port"] for d in selected for p in d["spec"]["ports"] if p["name"] == endpoint["port"]}
    assert ports == {9400, 9401}
