"""gRPC TLS and mTLS on a real gateway, with a CA and certificates made in the test."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import TokenRelayClient
from gateway.tls import channel_credentials
from protos.tokenrelay.v1 import generate_pb2, generate_pb2_grpc
from tests.factories import CountingEngine
from tests.service import ROOT, GatewayThread, WorkerThread


@dataclass(frozen=True)
class Identity:
    cert: str  # paths of PEM files
    key: str


class CertFactory:
    """A private CA in `folder` that signs server and client certificates."""

    def __init__(self, folder: Path, name: str = "test-ca") -> None:
        self.folder = folder
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (self._builder(subject, self.key.public_key()).issuer_name(subject)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca = self._write(f"{name}.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def _write(self, name: str, data: bytes) -> str:
        path = self.folder / name
        path.write_bytes(data)
        return str(path)

    def issue(self, name: str, *, is_server: bool, dns: Sequence[str] = (), uris: Sequence[str] = ()
              ) -> Identity:
        """A certificate with CN=name (and these DNS and URI SANs) and its key, in name.crt/.key."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (self._builder(subject, key.public_key()).issuer_name(self.cert.subject)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        names: list[x509.GeneralName] = [*map(x509.DNSName, dns), *map(x509.UniformResourceIdentifier, uris)]
        if is_server:
            names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return Identity(self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                        self._write(f"{name}.key", key_pem))


@pytest.fixture
def certs(tmp_path: Path) -> CertFactory:
    return CertFactory(tmp_path)


def server_info(channel: grpc.Channel) -> generate_pb2.ServerInfo:
    stub = generate_pb2_grpc.TokenRelayStub(channel)
    return stub.GetServerInfo(generate_pb2.GetServerInfoRequest(), timeout=5)


def test_tls_calls_work_and_plaintext_clients_are_refused(
        certs: CertFactory, make_gateway: Callable[..., GatewayThread]) -> None:
    server = certs.issue("gateway", is_server=True)
    gateway = make_gateway(tls_cert=server.cert, tls_key=server.key)
    with grpc.secure_channel(gateway.target, channel_credentials(certs.ca)) as channel:
        assert server_info(channel).gateway_id == gateway.config.gateway_id
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with TokenRelayClient(gateway.target, ca=certs.ca) as client:  # the client class too
        assert client.server_info().gateway_id == gateway.config.gateway_id
    with grpc.insecure_channel(gateway.target) as channel, pytest.raises(grpc.RpcError) as e:
        server_info(channel)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    other_ca = CertFactory(certs.folder, "other-ca")  # a server the client's CA did not sign
    with grpc.secure_channel(gateway.target, channel_credentials(other_ca.ca)) as channel, \
            pytest.raises(grpc.RpcError) as e:
        server_info(channel)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(
        certs: CertFactory, make_gateway: Callable[..., GatewayThread]) -> None:
    server, client = certs.issue("gateway", is_server=True), certs.issue("backend", is_server=False)
    gateway = make_gateway(tls_cert=server.cert, tls_key=server.key, tls_client_ca=certs.ca)
    creds = channel_credentials(certs.ca, client.cert, client.key)
    with grpc.secure_channel(gateway.target, creds) as channel:
        assert server_info(channel).gateway_id == gateway.config.gateway_id
    stranger = CertFactory(certs.folder, "stranger-ca").issue("intruder", is_server=False)
    for creds in (channel_credentials(certs.ca), channel_credentials(certs.ca, stranger.cert, stranger.key)):
        with grpc.secure_channel(gateway.target, creds) as channel, pytest.raises(grpc.RpcError) as e:
            server_info(channel)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bad_tls_files_are_clean_usage_errors(certs: CertFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import config_from_args

    server, other = certs.issue("gateway", is_server=True), certs.issue("other", is_server=True)
    cases = [
        (["--tls-cert", "/no/such.crt", "--tls-key", server.key], "tls_cert '/no/such.crt' cannot be read"),
        (["--tls-cert", server.cert, "--tls-key", "/no/such.key"], "tls_key '/no/such.key' cannot be read"),
        (["--tls-key", server.key], "tls_key is set but tls_cert is not"),
        (["--tls-cert", server.cert], "tls_cert is set but tls_key is not"),
        (["--tls-client-ca", certs.ca], "tls_client_ca (mTLS) needs tls_cert"),
        (["--tls-cert", server.cert, "--tls-key", other.key], "are not a PEM certificate and its"),
        (["--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", server.key],
         "holds no PEM CA certificate"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            config_from_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv
    argv = [sys.executable, "-m", "gateway", "--tls-cert", "/no/such.crt", "--tls-key", server.key]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot be read" in proc.stderr and "Traceback" not in proc.stderr


def test_the_client_command_checks_its_tls_flags(certs: CertFactory) -> None:
    client = certs.issue("backend", is_server=False)
    proc = subprocess.run([sys.executable, "-m", "gateway.client", "--cert", client.cert, "hi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--cert with --key" in proc.stderr and "Traceback" not in proc.stderr


def test_the_bench_connects_with_tls_and_a_token(certs: CertFactory, tmp_path: Path,
                                                 make_gateway: Callable[..., GatewayThread]) -> None:
    import asyncio

    from gateway import bench, cli

    token = "bench-token-0123456789"
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"load": {"tokens": [token], "admin": True}}}))
    server = certs.issue("gateway", is_server=True)
    gateway = make_gateway(tls_cert=server.cert, tls_key=server.key, auth_tokens_file=str(tenants))

    async def info(config: bench.BenchConfig) -> dict[str, object]:
        async with bench._channel(config) as channel:
            return await bench._server_info(generate_pb2_grpc.TokenRelayStub(channel), config)

    args = cli.build_parser().parse_args(["bench", "--target", gateway.target, "--ca", certs.ca,
                                          "--token", token])
    assert asyncio.run(info(bench.config_from_args(args)))["gateway_id"] == gateway.config.gateway_id
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        asyncio.run(info(bench.BenchConfig(target=gateway.target, ca=certs.ca)))


# -- tenants bound to client certificates ------------------------------------------------------------------

BOUND_TENANTS = {
    "acme": {"client_identities": ["CN=svc-a"]},
    "mesh": {"client_identities": ["spiffe://corp/ns/a/sa/b", "DNS:Mesh.Corp"]},
    "both": {"client_identities": ["CN=svc-both"], "tokens": ["both-token-0123456789"]},
    "tok": {"tokens": ["tok-token-0123456789"]},
}


@pytest.fixture
def bound_gateway(certs: CertFactory, tmp_path: Path, make_gateway: Callable[..., GatewayThread],
                  start_worker: Callable[..., WorkerThread]) -> GatewayThread:
    """An mTLS gateway whose tenants file binds tenants to client certificates, and a worker."""
    server = certs.issue("gateway", is_server=True)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": BOUND_TENANTS}))
    start_worker(CountingEngine())
    return make_gateway(tls_cert=server.cert, tls_key=server.key, tls_client_ca=certs.ca,
                        auth_tokens_file=str(tenants))


def generate(gateway: GatewayThread, certs: CertFactory, client: Identity,
             token: str | None = None) -> generate_pb2.GenerateResponse:
    """The final response of a 2-token Generate with this client certificate (and token)."""
    with TokenRelayClient(gateway.target, ca=certs.ca, cert=client.cert, key=client.key, token=token) as c:
        return list(c.generate("hi", max_tokens=2, timeout_s=10))[-1]


def refusal(gateway: GatewayThread, certs: CertFactory, client: Identity, token: str | None = None
            ) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        generate(gateway, certs, client, token)
    return e.value.code(), e.value.details() or ""


def test_a_client_certificate_bound_to_a_tenant_needs_no_token(
        certs: CertFactory, bound_gateway: GatewayThread) -> None:
    by_cn = certs.issue("svc-a", is_server=False)
    by_san = certs.issue("any-name", is_server=False, uris=["spiffe://corp/ns/a/sa/b"])
    by_dns = certs.issue("other-name", is_server=False, dns=["mesh.corp"])  # DNS names: any case
    assert generate(bound_gateway, certs, by_cn).final.tenant == "acme"
    assert generate(bound_gateway, certs, by_cn).final.text == "xx"
    assert generate(bound_gateway, certs, by_san).final.tenant == "mesh"
    assert generate(bound_gateway, certs, by_dns).final.tenant == "mesh"
    both = certs.issue("svc-both", is_server=False)  # a certificate and a token of the same tenant
    assert generate(bound_gateway, certs, both, "both-token-0123456789").final.tenant == "both"
    unbound = certs.issue("backend", is_server=False)  # the token decides
    assert generate(bound_gateway, certs, unbound, "tok-token-0123456789").final.tenant == "tok"


def test_an_unbound_or_contradicting_client_certificate_is_unauthenticated(
        certs: CertFactory, bound_gateway: GatewayThread) -> None:
    unbound, bound = certs.issue("backend", is_server=False), certs.issue("svc-a", is_server=False)
    code, details = refusal(bound_gateway, certs, unbound)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "client certificate (CN=backend) is bound to no tenant" in details
    code, details = refusal(bound_gateway, certs, bound, "tok-token-0123456789")
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "bound to tenant 'acme' but the bearer token names tenant 'tok'" in details
    code, details = refusal(bound_gateway, certs, bound, "not-a-token-0123456789")  # a bad token: refused
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid")
    two = certs.issue("svc-a", is_server=False, dns=["mesh.corp"])  # acme by its CN, mesh by its SAN
    code, details = refusal(bound_gateway, certs, two)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bound to more than one tenant" in details


def test_client_identities_without_mtls_are_refused_at_start_up(
        certs: CertFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import config_from_args

    server = certs.issue("gateway", is_server=True)
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"acme": {"client_identities": ["CN=svc-a"]}}}))
    argv = ["--tls-cert", server.cert, "--tls-key", server.key, "--auth-tokens-file", str(tenants)]
    with pytest.raises(SystemExit) as exit_:
        config_from_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "tenant 'acme' has client_identities, but the gateway has no " \
        "--tls-client-ca" in err and "could never be verified" in err
    config, _ = config_from_args([*argv, "--tls-client-ca", certs.ca])
    assert config.tls_client_ca == certs.ca
