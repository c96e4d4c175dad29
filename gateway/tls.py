"""gRPC TLS and mTLS: checks of the PEM files, the gateway's certificate reloaded while it
serves, credentials for clients, and the gateway's port (secure or not, with a warning where
that exposes calls).

The files are checked with the standard library's `ssl` (a key that does not match its
certificate, a file that is no PEM, an encrypted key) so a bad file stops the process at
start-up with a message naming it, instead of gRPC failing to bind with a bare error.

Reloading (`ServerCertificates`): the port's credentials are gRPC's dynamic ones, whose
fetcher gRPC core calls before each new handshake. It stats the files (no read) and reads
them again when one changed, as when cert-manager and the kubelet rotate a Secret-mounted
file in place; SIGHUP reads them again whatever their stat says. New files are checked as
at start-up first: a bad one (unreadable, no PEM, a key that does not match its certificate)
is logged and the material in force stays; files that change while they are read are read
again at the next handshake. New handshakes get the new certificate; open connections, and
the calls on them, keep theirs. The log names the certificate in force (subject, serial,
not-after, SHA-256 fingerprint), never the key. The --tls-client-ca file (the CAs that sign
client certificates) is reloaded with them; whether a client must present a certificate is
fixed at start-up.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

log = logging.getLogger(__name__)

PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
FileStat = tuple[int, ...]  # what os.stat says of a file that changes when its content does


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{name} {path!r} cannot be read: {e.strerror or e}") from None


def check_server_files(cert: str, key: str, client_ca: str) -> None:
    """ValueError naming the problem unless cert + key (+ client_ca) make a usable server identity."""
    if key and not cert:
        raise ValueError("tls_key is set but tls_cert is not: TLS needs both the certificate and its key")
    if cert and not key:
        raise ValueError("tls_cert is set but tls_key is not: TLS needs both the certificate and its key")
    if client_ca and not cert:
        raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key: client certificates are "
                         "only checked on a TLS port")
    if cert:
        _load(cert, key, client_ca)


@dataclass(frozen=True)
class _Material:
    """One read of the PEM files, checked: what new handshakes are given."""

    cert: bytes
    key: bytes = field(repr=False)
    client_ca: bytes | None
    description: str  # subject, serial, not-after, fingerprint: what the log says is in force
    is_expired: bool

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)],
                                                         root_certificates=self.client_ca)


def _load(cert: str, key: str, client_ca: str) -> _Material:
    """Read and check the files; ValueError naming the first problem."""
    cert_pem, key_pem = _read("tls_cert", cert), _read("tls_key", key)
    ca_pem = _read("tls_client_ca", client_ca) if client_ca else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(f"tls_cert {cert!r} and tls_key {key!r} are not a PEM certificate and its "
                         f"(unencrypted) private key: {e.reason or e}") from None
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as e:
            raise ValueError(f"tls_client_ca {client_ca!r} holds no PEM CA certificate: "
                             f"{e.reason or e}") from None
    decoded = _decode(cert)
    not_after = decoded.get("notAfter")
    return _Material(cert_pem, key_pem, ca_pem, describe_certificate(decoded, cert_pem),
                     is_expired=not_after is not None and ssl.cert_time_to_seconds(not_after) < time.time())


def _decode(path: str) -> dict[str, Any]:
    """The first certificate of the PEM file, as ssl.SSLSocket.getpeercert() shows one; {} if the
    decoder is missing (it is CPython's, not public API, but in every CPython 3)."""
    try:
        import _ssl
        return dict(_ssl._test_decode_cert(path))  # type: ignore[attr-defined]
    except Exception:  # the fingerprint alone still names the certificate
        return {}


def describe_certificate(decoded: dict[str, Any], pem: bytes) -> str:
    """'subject CN=x, serial 1F.., not after <date>, sha256 ab..' (the first certificate of pem)."""
    first = PEM_CERT.search(pem)
    fingerprint = hashlib.sha256(base64.b64decode(first.group(1))).hexdigest() if first else "?"
    if not decoded:
        return f"sha256 {fingerprint}"
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
             "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}
    subject = ",".join(f"{short.get(name, name)}={value}"
                       for rdn in decoded.get("subject", ()) for name, value in rdn)
    return (f"subject {subject or '(empty)'}, serial {decoded.get('serialNumber', '?')}, "
            f"not after {decoded.get('notAfter', '?')}, sha256 {fingerprint}")


class ServerCertificates:
    """The gRPC port's certificate, key and client CA, read again when they change (see the
    module docstring). gRPC core calls `_fetch` on its own threads; `reload` runs on SIGHUP."""

    def __init__(self, cert: str, key: str, client_ca: str) -> None:
        self.paths = (cert, key, client_ca)
        self._lock = threading.Lock()
        self._seen = self._stat()  # of the files last read, good or bad: read again once it differs
        self._material = _load(*self.paths)  # ValueError: the process does not start
        self._pending: grpc.ServerCertificateConfiguration | None = None  # for the next handshake
        self._log_in_force("TLS certificate in force")

    @property
    def description(self) -> str:
        """The certificate in force for new handshakes: subject, serial, not-after, fingerprint."""
        return self._material.description

    def credentials(self) -> grpc.ServerCredentials:
        """TLS with this identity; with a client CA every client must present a certificate it signed."""
        return grpc.dynamic_ssl_server_credentials(
            self._material.configuration(), self._fetch,
            require_client_authentication=self._material.client_ca is not None)

    def reload(self, *, is_forced: bool = True) -> bool:
        """Read the files again (not forced: only if their stat changed); True if new material
        goes to new handshakes. A bad file is logged and the material in force stays."""
        with self._lock:
            before = self._stat()
            if not is_forced and before == self._seen:
                return False
            try:
                material: _Material | ValueError = _load(*self.paths)
            except ValueError as e:
                material = e
            if self._stat() != before:  # written while read (a copy, not an atomic swap)
                log.info("TLS files changed while being read: read again at the next handshake")
                return False
            self._seen = before
            if isinstance(material, ValueError):
                log.error("TLS certificate not reloaded, %s stays in force: %s", self.description, material)
                return False
            if material == self._material:
                log.info("TLS files unchanged: %s stays in force", self.description)
                return False
            self._material, self._pending = material, material.configuration()
            self._log_in_force("TLS certificate reloaded, in force for new connections")
        return True

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher, before each new handshake: new material once, else None (keep it)."""
        try:
            self.reload(is_forced=False)
        except Exception:  # it would reach gRPC core: log it, keep what is in force
            log.exception("the TLS files could not be checked for a change")
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _stat(self) -> tuple[FileStat, ...]:
        """Follows symlinks: the kubelet swaps a Secret volume's `..data` link, not the files."""
        stats: list[FileStat] = []
        for path in filter(None, self.paths):
            try:
                s = os.stat(path)
            except OSError as e:
                stats.append((-1, e.errno or 0))
            else:
                stats.append((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
        return tuple(stats)

    def _log_in_force(self, what: str) -> None:
        log.info("%s: %s (%s)", what, self._material.description, self.paths[0])
        if self._material.is_expired:
            log.warning("the TLS certificate in force has expired, clients refuse it: %s",
                        self._material.description)


def channel_credentials(ca: str | None = None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials:
    """Client TLS: trust `ca` (None = the system's roots); cert + key = a client identity for mTLS."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs its key and a key its certificate (--cert with --key)")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("ca", ca) if ca else None,
        private_key=_read("key", key) if key else None,
        certificate_chain=_read("cert", cert) if cert else None)


def is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(server: grpc.aio.Server, listen: str, certificates: ServerCertificates | None, *,
         is_authenticated: bool) -> int:
    """The bound port: TLS with certificates, plaintext without; warns where an address other
    hosts reach takes unauthenticated or plaintext calls. OSError if nothing could be bound."""
    if certificates is not None:
        port = server.add_secure_port(listen, certificates.credentials())
    else:
        port = server.add_insecure_port(listen)
    if not port:
        raise OSError(f"cannot listen on {listen}")
    if not is_loopback(listen):
        if not is_authenticated:
            log.warning("no --auth-tokens-file: the gateway accepts unauthenticated calls on %s", listen)
        if certificates is None:
            log.warning("no --tls-cert: calls and tokens on %s travel in plaintext", listen)
    return port
