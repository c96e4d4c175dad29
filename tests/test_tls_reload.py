"""The gateway's TLS certificate replaced while it serves: files changed in place (as the kubelet
rotates a Secret volume), SIGHUP, bad new files; open calls keep their connection."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from gateway.client import TokenRelayClient
from gateway.redis_server import free_port
from protos.keys import Keys
from tests.factories import CountingEngine
from tests.service import ROOT, GatewayThread, WorkerThread, wait_until
from tests.test_tls import CertFactory, Identity
from worker.config import DEFAULT_MODEL_NAME


@pytest.fixture
def certs(tmp_path: Path) -> CertFactory:
    return CertFactory(tmp_path)


def peer_name(target: str, ca: str, client: Identity | None = None) -> str:
    """The CN of the certificate a new TLS connection to target gets (checked against ca)."""
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    host, _, port = target.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock, \
            context.wrap_socket(sock, server_hostname="localhost") as tls:
        peer: dict[str, Any] = tls.getpeercert() or {}
    return next(str(value) for rdn in peer["subject"] for name, value in rdn if name == "commonName")


class SecretVolume:
    """tls.crt and tls.key the way the kubelet mounts a Secret: links to `..data/`, itself a link
    to a timestamped folder that an update replaces with one atomic rename."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        self.cert, self.key = str(folder / "tls.crt"), str(folder / "tls.key")
        self._version = 0

    def write(self, identity: Identity) -> None:
        self._version += 1
        target = self.folder / f"..v{self._version}"
        target.mkdir()
        shutil.copy(identity.cert, target / "tls.crt")
        shutil.copy(identity.key, target / "tls.key")
        (self.folder / "..data_tmp").symlink_to(target.name)
        os.replace(self.folder / "..data_tmp", self.folder / "..data")
        for name in ("tls.crt", "tls.key"):
            if not (self.folder / name).is_symlink():
                (self.folder / name).symlink_to(f"..data/{name}")


def test_a_rotated_certificate_reaches_new_connections_and_open_calls_go_on(
        certs: CertFactory, tmp_path: Path, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture,
        make_gateway: Callable[..., GatewayThread], start_worker: Callable[..., WorkerThread]) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tls")
    volume = SecretVolume(tmp_path / "secret")
    volume.write(certs.issue("gateway-1", is_server=True))
    client = certs.issue("backend", is_server=False)
    gateway = make_gateway(tls_cert=volume.cert, tls_key=volume.key, tls_client_ca=certs.ca)
    assert peer_name(gateway.target, certs.ca, client) == "gateway-1"
    with TokenRelayClient(gateway.target, ca=certs.ca, cert=client.cert, key=client.key) as open_client:
        call = open_client.generate("hi", max_tokens=3, timeout_s=30)  # no worker yet: it waits, queued
        queue = redis.Redis.from_url(redis_url)
        wait_until(lambda: queue.xlen(Keys(prefix, DEFAULT_MODEL_NAME).requests) == 1, timeout=10)
        queue.close()
        volume.write(certs.issue("gateway-2", is_server=True))
        assert peer_name(gateway.target, certs.ca, client) == "gateway-2"  # seen at the handshake
        start_worker(CountingEngine())
        assert list(call)[-1].final.text == "xxx"  # the call opened under gateway-1 ended normally
    reloaded = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert len(reloaded) == 1 and "subject CN=gateway-2, serial " in reloaded[0]
    assert "not after" in reloaded[0] and "sha256" in reloaded[0]
    assert "PRIVATE KEY" not in caplog.text


def test_a_bad_new_certificate_is_logged_and_the_old_one_stays(
        certs: CertFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        make_gateway: Callable[..., GatewayThread]) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tls")
    first, other = certs.issue("gateway-1", is_server=True), certs.issue("gateway-2", is_server=True)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    gateway = make_gateway(tls_cert=str(cert), tls_key=str(key))
    assert gateway.gateway is not None
    bad_files = [
        (lambda: shutil.copy(other.cert, cert), "are not a PEM certificate and its"),  # the key of gateway-1
        (lambda: key.unlink(), f"tls_key {str(key)!r} cannot be read"),
        (lambda: key.write_text("not a key"), "are not a PEM certificate and its"),
    ]
    for break_files, message in bad_files:
        caplog.clear()
        break_files()
        assert peer_name(gateway.target, certs.ca) == "gateway-1"
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and message in errors[0], errors
        assert "TLS certificate not reloaded, subject CN=gateway-1, serial" in errors[0]
        assert not gateway.gateway.reload_tls()  # SIGHUP: the same refusal
    shutil.copy(other.key, key)
    assert peer_name(gateway.target, certs.ca) == "gateway-2"
    assert not gateway.gateway.reload_tls()  # nothing new since
    assert "TLS files unchanged: subject CN=gateway-2" in caplog.text
    assert "PRIVATE KEY" not in caplog.text and "not a key" not in caplog.text


def test_sighup_reloads_the_certificate_of_a_gateway_process(
        certs: CertFactory, tmp_path: Path, redis_url: str, prefix: str) -> None:
    first, second = certs.issue("gateway-1", is_server=True), certs.issue("gateway-2", is_server=True)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    target = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "gateway.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--listen", target, "--redis-url", redis_url, "--key-prefix",
             prefix, "--metrics-port", "0", "--tls-cert", str(cert), "--tls-key", str(key)],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def answers() -> str:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        try:
            return peer_name(target, certs.ca)
        except OSError:
            return ""

    try:
        assert wait_until(answers, timeout=30, interval=0.1) == "gateway-1"
        shutil.copy(second.cert, cert)
        shutil.copy(second.key, key)
        proc.send_signal(signal.SIGHUP)  # before any new handshake: the reload is the signal's
        wait_until(lambda: "TLS certificate reloaded" in log_path.read_text(), timeout=10)
        assert "subject CN=gateway-2" in log_path.read_text().split("TLS certificate reloaded")[1]
        assert answers() == "gateway-2"
        key.write_text("not a key")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "TLS certificate not reloaded" in log_path.read_text(), timeout=10)
        assert answers() == "gateway-2" and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert "PRIVATE KEY" not in log_path.read_text()


def test_a_client_ca_replaced_in_place_decides_new_connections(
        certs: CertFactory, tmp_path: Path, make_gateway: Callable[..., GatewayThread]) -> None:
    server = certs.issue("gateway", is_server=True)
    new_ca = CertFactory(tmp_path, "new-client-ca")
    old_client, new_client = certs.issue("old-backend", is_server=False), new_ca.issue("new-backend",
                                                                                         is_server=False)

    def client(identity: Identity) -> TokenRelayClient:
        return TokenRelayClient(gateway.target, ca=certs.ca, cert=identity.cert, key=identity.key)

    client_ca = tmp_path / "client-ca.pem"
    shutil.copy(certs.ca, client_ca)
    gateway = make_gateway(tls_cert=server.cert, tls_key=server.key, tls_client_ca=str(client_ca))
    with client(old_client) as old:
        old.server_info()  # connected under the old CA
        shutil.copy(new_ca.ca, client_ca)
        with client(new_client) as new:
            new.server_info()
        with client(old_client) as again, pytest.raises(grpc.RpcError) as e:
            again.server_info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        old.server_info()  # its connection was made under the old CA: it stays


def test_files_that_change_while_read_are_read_again_at_the_next_handshake(
        certs: CertFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from gateway import tls

    caplog.set_level(logging.INFO, logger="gateway.tls")
    first, second = certs.issue("gateway-1", is_server=True), certs.issue("gateway-2", is_server=True)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    certificates = tls.ServerCertificates(str(cert), str(key), "")
    load, copies = tls._load, [lambda: shutil.copy(second.key, key)]

    def load_during_a_copy(*paths: str) -> object:
        try:
            return load(*paths)
        finally:
            while copies:  # a non-atomic update: the key lands while the files are read
                copies.pop()()

    monkeypatch.setattr(tls, "_load", load_during_a_copy)
    shutil.copy(second.cert, cert)  # with the old key: no pair, but the key is on its way
    assert certificates._fetch() is None  # what gRPC asks before a handshake: keep the old
    assert "changed while being read" in caplog.text and "not reloaded" not in caplog.text
    assert "CN=gateway-1" in certificates.description
    assert certificates._fetch() is not None and "CN=gateway-2" in certificates.description  # the next one
    assert certificates._fetch() is None  # handed over once
