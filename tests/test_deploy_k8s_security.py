"""deploy/k8s is secure as shipped, checked offline on the rendered overlays (tests/k8s_render.py):
the gateway speaks TLS and authenticates (no reflection), Redis speaks TLS
only and every Redis URL is rediss:// with the CA of its certificate, NetworkPolicies deny
what they do not allow (Redis only from gateways, workers and KEDA; /metrics only from
Prometheus, on Services of their own), and every container runs locked down. The gateway's TLS
probes run against a real gateway here; tests/test_redis_tls.py runs the Redis pod's.
Redis memory is bounded and never evicted.
"""

from __future__ import annotations

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

import pytest
import yaml

from tests.k8s_render import (
    DEPLOY,
    OVERLAYS,
    RENDERED,
    container,
    env_of,
    find,
    gateway_certificate,
    matches,
    mounted_secret_dir,
    redis_certificate,
    worker_sets,
    workloads,
    write_tls_files,
)

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
