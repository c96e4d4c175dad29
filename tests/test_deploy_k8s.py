"""deploy/k8s (kustomize base + cpu/gpu overlays), offline: each overlay renders, core kinds pass
kubernetes-validate (strict, Kubernetes VALIDATE_VERSION), KEDA's ScaledObject and
TriggerAuthentication, cert-manager's Certificate and Issuer and the ServiceMonitor pass
check-jsonschema against the CRD schemas vendored in deploy/k8s/schemas, every YAML under deploy/
passes yamllint (deploy/.yamllint), and the manifests agree with the code: stream and group
names, drain timeout vs grace period, the ACL users and their Secret, lagCount vs max_num_seqs,
the flags and files the gateway is started with.

Secure as shipped: the gateway speaks TLS and authenticates (no reflection), Redis speaks TLS
only and every Redis URL is rediss:// with the CA of its certificate, NetworkPolicies deny
what they do not allow (Redis only from gateways, workers and KEDA; /metrics only from
Prometheus, on Services of their own), and every container runs locked down. The gateway's TLS
probes run against a real gateway here; tests/test_redis_tls.py runs the Redis pod's.

Rendering: `kubectl kustomize` when kubectl is installed, else `render` below (resources,
configMapGenerator, strategic-merge patches by kind and name, labels, namespace: what these
kustomizations use); where kubectl exists both are compared.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

from protos.keys import Keys

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = ("cpu", "gpu", "two-models")
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


def workload(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The Deployment (the gateway) or StatefulSet (Redis, the workers) of that name."""
    found = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{name}: {len(found)} found"
    return found[0]


def container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return workload(docs, name)["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def worker_sets(docs: list[dict[str, Any]]) -> list[str]:
    """The names of the worker StatefulSets (one per served model), sorted."""
    return sorted(d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"
                  and d["spec"]["template"]["metadata"]["labels"].get("app") == "tokenrelay-worker")


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> pod template of every Deployment and StatefulSet."""
    return {d["metadata"]["name"]: d["spec"]["template"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


def matches(selector: dict[str, Any], metadata: dict[str, Any]) -> bool:
    """A label selector (matchLabels, and matchExpressions with In) against an object's labels."""
    labels = metadata.get("labels", {})
    return (all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            and all(e["operator"] == "In" and labels.get(e["key"]) in e["values"]
                    for e in selector.get("matchExpressions", [])))


def redis_certificate(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Certificate", "tokenrelay-redis")["spec"]


def gateway_certificate(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Certificate", "tokenrelay-gateway")["spec"]


def mounted_secret_dir(docs: list[dict[str, Any]], workload: str, secret: str) -> str:
    """Where the workload's first container mounts the Secret (exactly one volume of it)."""
    pod = workloads(docs)[workload]["spec"]
    (volume,) = [v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
    (path,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume]
    return str(path)


def write_tls_files(folder: Path, dns_names: list[str]) -> Path:
    """`folder` with ca.crt, tls.crt and tls.key, as cert-manager writes a Certificate's Secret: a
    throwaway CA and a server certificate for `dns_names` (DNS names only, no IP address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: str, public_key: Any, signer: Any, is_ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if not is_ca:
            names = x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names])
            usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
            builder = builder.add_extension(names, critical=False).add_extension(usage, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("test CA", "test CA", ca_key.public_key(), ca_key, is_ca=True)
    cert = build(dns_names[0], "test CA", key.public_key(), ca_key, is_ca=False)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return folder


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


# -- secure as shipped ---------------------------------------------------------------------------------

# Pods outside the namespace that the NetworkPolicies let in (deploy/k8s/README.md documents them).
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
KEDA_OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}}}
DNS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
       "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_starts_with_tls_and_a_tenants_file_and_without_reflection(
        overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.__main__ import build_parser

    docs = RENDERED[overlay]
    gateway = container(docs, "tokenrelay-gateway")
    for name in [n for n in os.environ if n.startswith("TOKENRELAY_") or n == "REDIS_URL"]:
        monkeypatch.delenv(name)  # the pod's environment only
    for name, value in env_of(gateway).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args(gateway["args"])  # every flag exists
    assert "--reflection" not in gateway["args"] and args.reflection is False
    tls_dir = mounted_secret_dir(docs, "tokenrelay-gateway", gateway_certificate(docs)["secretName"])
    assert (args.tls_cert, args.tls_key) == (f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key")
    assert args.tls_client_ca == ""  # mTLS is the operator's choice (README)
    tenants_dir, _, tenants_file = args.auth_tokens_file.rpartition("/")
    assert tenants_dir == mounted_secret_dir(docs, "tokenrelay-gateway", "tokenrelay-tenants")
    assert tenants_file in find(docs, "Secret", "tokenrelay-tenants")["stringData"]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert int(args.listen.rpartition(":")[2]) == ports["grpc"] and args.metrics_port == ports["metrics"]


def test_the_example_tenants_file_loads_and_holds_only_placeholders(tmp_path: Path) -> None:
    from gateway.auth import load_tenants

    (name, text), = find(RENDERED["cpu"], "Secret", "tokenrelay-tenants")["stringData"].items()
    (tmp_path / name).write_text(text)
    assert load_tenants(str(tmp_path / name))  # the gateway would start with it
    tokens = [t for tenant in json.loads(text)["tenants"].values() for t in tenant["tokens"]]
    assert tokens and all(t.startswith("CHANGE-ME-") for t in tokens)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_speaks_tls_only_with_its_certificate(overlay: str) -> None:
    docs = RENDERED[overlay]
    redis = find(docs, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]["containers"][0]
    args = dict(zip(redis["args"][::2], redis["args"][1::2], strict=True))
    (port,) = [p["containerPort"] for p in redis["ports"] if p["name"] == "redis"]
    assert args["--port"] == "0" and args["--tls-port"] == str(port)  # no plaintext port
    tls_dir = mounted_secret_dir(docs, "tokenrelay-redis", redis_certificate(docs)["secretName"])
    assert (args["--tls-cert-file"], args["--tls-key-file"], args["--tls-ca-cert-file"]) == (
        f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt")
    assert args["--tls-auth-clients"] in ("no", "optional")  # clients log in with their ACL password


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_redis_url_is_rediss_with_the_ca_of_redis_certificate(overlay: str) -> None:
    docs = RENDERED[overlay]
    certificate, urls = redis_certificate(docs), []
    for name, template in workloads(docs).items():
        pod = template["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            values = list(env.values())
            # A worker builds its URL in its command, its password from the init container's file.
            built = re.search(r'REDIS_URL="([^"]+)"', " ".join(c.get("command", [])))
            if built:
                values.append(built.group(1).replace("$REDIS_ADDRESS", env["REDIS_ADDRESS"])
                              .replace("$(cat /run/redis-auth/password)", "FILE"))
                (auth,) = [v for v in pod["volumes"] if v["name"] == "redis-auth"]
                assert auth["emptyDir"]["medium"] == "Memory", name  # never on a disk
            for value in values:
                if re.match(r"redis[+\w]*://", value) or value.startswith("unix://"):
                    urls.append((name, pod, c, urlsplit(value)))
    assert sorted(name for name, *_ in urls) == ["tokenrelay-gateway", *worker_sets(docs)]
    for name, pod, c, url in urls:
        assert url.scheme == "rediss", name
        # from the Secret, in the pod only; a worker's from the file its own init container wrote
        assert url.password == ("$(REDIS_PASSWORD)" if name == "tokenrelay-gateway" else "FILE"), name
        assert url.hostname in certificate["dnsNames"], name  # redis-py checks it
        query = parse_qs(url.query)
        assert set(query) == {"ssl_ca_certs"}, name  # nothing that turns a check off
        directory, _, file = query["ssl_ca_certs"][0].rpartition("/")
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
        (volume,) = [v["secret"] for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secretName"] == certificate["secretName"], name
        assert volume["items"] == [{"key": "ca.crt", "path": file}], name  # the CA, not Redis's key


def policies(docs: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """The NetworkPolicies that select the workload's pods."""
    labels = workloads(docs)[workload]["metadata"]
    return [d["spec"] for d in docs
            if d["kind"] == "NetworkPolicy" and matches(d["spec"]["podSelector"], labels)]


def ingress_rules(docs: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    return [rule for p in policies(docs, workload) for rule in p.get("ingress", [])]


def selected_workloads(docs: list[dict[str, Any]], peer: dict[str, Any]) -> set[str]:
    """The namespace's workloads a peer without namespaceSelector selects."""
    assert set(peer) == {"podSelector"}, peer
    return {name for name, t in workloads(docs).items() if matches(peer["podSelector"], t["metadata"])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default(overlay: str) -> None:
    docs = RENDERED[overlay]
    default = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"] == {}]
    assert default == [{"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}]  # no rule: nothing allowed
    for name in workloads(docs):
        assert all("ipBlock" not in peer for p in policies(docs, name) for rule in p.get("ingress", [])
                   + p.get("egress", []) for peer in rule.get("from", rule.get("to", []))), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_gateways_workers_and_keda_reach_redis(overlay: str) -> None:
    docs = RENDERED[overlay]
    rules = ingress_rules(docs, "tokenrelay-redis")
    assert rules and all(rule.get("from") for rule in rules)  # no rule open to everyone
    peers = [peer for rule in rules for peer in rule["from"]]
    inside = [peer for peer in peers if "namespaceSelector" not in peer]
    assert [peer for peer in peers if "namespaceSelector" in peer] == [KEDA_OPERATOR]
    assert all(selected_workloads(docs, peer) for peer in inside)  # each selects someone
    assert set().union(*(selected_workloads(docs, peer) for peer in inside)) == {"tokenrelay-gateway",
                                                                                  *worker_sets(docs)}
    assert all(rule["ports"] == [{"port": "redis", "protocol": "TCP"}] for rule in rules)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_prometheus_reaches_the_metrics_ports_and_clients_only_grpc(overlay: str) -> None:
    docs = RENDERED[overlay]
    for name in ("tokenrelay-gateway", "tokenrelay-worker"):
        ports = {p["name"] for p in workloads(docs)[name]["spec"]["containers"][0]["ports"]}
        opened: dict[str, list[Any]] = {}
        for rule in ingress_rules(docs, name):
            for port in rule["ports"]:
                opened.setdefault(port["port"], []).append(rule.get("from"))
        assert set(opened) == ports, name  # named ports, each one of the container's
        assert opened["metrics"] == [[PROMETHEUS]], name
        if name == "tokenrelay-gateway":
            assert opened["grpc"] == [None]  # clients: the README says how to narrow it


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_and_workers_open_connections_to_redis_and_dns_only(overlay: str) -> None:
    docs = RENDERED[overlay]
    (redis_port,) = find(docs, "Service", "redis")["spec"]["ports"]
    for name in ("tokenrelay-gateway", "tokenrelay-worker"):
        (policy,) = [p for p in policies(docs, name) if p["podSelector"]]
        assert "Egress" in policy["policyTypes"]
        redis_rule, dns_rule = policy["egress"]
        (peer,) = redis_rule["to"]
        assert selected_workloads(docs, peer) == {"tokenrelay-redis"}
        assert redis_rule["ports"] == [{"port": redis_port["port"], "protocol": "TCP"}]
        assert dns_rule == {"to": [DNS], "ports": [{"port": 53, "protocol": "UDP"},
                                                   {"port": 53, "protocol": "TCP"}]}
    assert all("egress" not in p for p in policies(docs, "tokenrelay-redis"))  # Redis dials nobody


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_have_services_of_their_own_and_the_grpc_service_only_grpc(overlay: str) -> None:
    docs = RENDERED[overlay]
    assert find(docs, "Service", "tokenrelay")["spec"]["ports"] == [
        {"port": 50051, "targetPort": "grpc", "name": "grpc"}]
    metrics_ports = {9400, 9401}
    for service in (d for d in docs if d["kind"] == "Service"):
        ports = {p[key] for p in service["spec"]["ports"] for key in ("port", "targetPort")}
        if service["metadata"]["name"].endswith("-metrics"):
            assert ports == {"metrics", *(ports & metrics_ports)} and service["spec"]["clusterIP"] == "None"
        else:
            assert not ports & (metrics_ports | {"metrics"}), service["metadata"]["name"]


LOCKED_DOWN = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
               "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_locked_down(overlay: str) -> None:
    docs = RENDERED[overlay]
    labels = find(docs, "Namespace", "tokenrelay")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"  # the API server holds pods to it
    assert len(workloads(docs)) == 2 + len(worker_sets(docs))
    for name, template in workloads(docs).items():
        pod = template["spec"]
        assert pod.get("automountServiceAccountToken") is False, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{c['name']}"
            context = {**pod["securityContext"], **c.get("securityContext", {})}
            assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0, where
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert c["securityContext"] == LOCKED_DOWN, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_read_only_containers_write_where_a_volume_is_mounted(overlay: str) -> None:
    docs = RENDERED[overlay]

    def is_writable(workload: str, path: str) -> bool:
        """`path` is on an emptyDir or a PersistentVolume the workload's container mounts read-write."""
        (spec,) = [d["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                   and d["metadata"]["name"] == workload]
        pod = spec["template"]["spec"]
        volumes = ({v["name"] for v in pod["volumes"] if "emptyDir" in v}
                   | {claim["metadata"]["name"] for claim in spec.get("volumeClaimTemplates", [])})
        return any(f"{path}/".startswith(f"{m['mountPath'].rstrip('/')}/") and m["name"] in volumes
                   and not m.get("readOnly") for m in pod["containers"][0]["volumeMounts"])

    dockerfile = (DEPLOY / "Dockerfile.worker").read_text()
    cache = re.search(r"XDG_CACHE_HOME=(\S+)", dockerfile).group(1)  # type: ignore[union-attr]
    assert is_writable("tokenrelay-worker", cache)  # the CPU kernel is compiled there
    redis = find(docs, "StatefulSet", "tokenrelay-redis")["spec"]["template"]["spec"]["containers"][0]
    assert is_writable("tokenrelay-redis", redis["args"][redis["args"].index("--dir") + 1])  # the AOF
    copy_to = re.search(r"cp \S+ (\S+)", redis["command"][2]).group(1)  # type: ignore[union-attr]
    assert is_writable("tokenrelay-redis", copy_to)  # the certificate it loaded


def test_the_gateway_probes_answer_over_tls_on_a_real_gateway(
        tmp_path: Path, make_gateway: Callable[..., Any]) -> None:
    from grpc_health.v1 import health_pb2

    docs = RENDERED["cpu"]
    probe = tmp_path / "probe.py"
    probe.write_text(find(docs, "ConfigMap", "tokenrelay-gateway-probe")["data"]["probe.py"])
    tls = write_tls_files(tmp_path / "tls", gateway_certificate(docs)["dnsNames"])
    (name, text), = find(docs, "Secret", "tokenrelay-tenants")["stringData"].items()
    (tmp_path / name).write_text(text)
    gateway = make_gateway(tls_cert=str(tls / "tls.crt"), tls_key=str(tls / "tls.key"),
                           auth_tokens_file=str(tmp_path / name))  # the probes send no token
    port = gateway.target.rpartition(":")[2]

    def probe_exit_code(check: str) -> int:
        command = [sys.executable, "-I", str(probe), check, port, str(tls)]
        return subprocess.run(command, capture_output=True, timeout=30).returncode

    assert probe_exit_code("ready") == 0 and probe_exit_code("alive") == 0
    # NOT_SERVING (Redis lost, or shutting down): out of the Service, not restarted
    gateway.call(gateway.gateway.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
    assert probe_exit_code("ready") == 1 and probe_exit_code("alive") == 0
    # the probes check the served certificate against ca.crt: one another CA signed gets no answer
    shutil.copy(write_tls_files(tmp_path / "other", ["tokenrelay"]) / "ca.crt", tls / "ca.crt")
    assert probe_exit_code("alive") == 1


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
