"""deploy/k8s rendered offline for the tests that read its manifests (tests/test_deploy_k8s*.py,
tests/test_redis_tls.py): `kubectl kustomize` when kubectl is installed, else `render` below
(resources, configMapGenerator, strategic-merge patches by kind and name, labels, namespace: what
these kustomizations use), and helpers to find what the manifests say."""

from __future__ import annotations

import copy
import datetime
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = ("cpu", "gpu", "two-models")
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
