"""gRPC TLS and mTLS: start-up checks of the PEM files, credentials for server and client, and
the gateway's port (secure or not, with a warning where that exposes calls).

The files are checked with the standard library's `ssl` (a key that does not match its
certificate, a file that is no PEM, an encrypted key) so a bad file stops the process at
start-up with a message naming it, instead of gRPC failing to bind with a bare error.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl

import grpc

log = logging.getLogger(__name__)


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
    if not cert:
        return
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", client_ca)):
        if path:
            _read(name, path)
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


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """TLS with this identity; with client_ca, every client must present a certificate it signed."""
    ca = _read("tls_client_ca", client_ca) if client_ca else None
    return grpc.ssl_server_credentials([(_read("tls_key", key), _read("tls_cert", cert))],
                                       root_certificates=ca, require_client_auth=ca is not None)


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


def bind(server: grpc.aio.Server, listen: str, cert: str, key: str, client_ca: str, *,
         is_authenticated: bool) -> int:
    """The bound port: TLS with a cert, plaintext without; warns where an address other hosts
    reach takes unauthenticated or plaintext calls. OSError if nothing could be bound."""
    if cert:
        port = server.add_secure_port(listen, server_credentials(cert, key, client_ca))
    else:
        port = server.add_insecure_port(listen)
    if not port:
        raise OSError(f"cannot listen on {listen}")
    if not is_loopback(listen):
        if not is_authenticated:
            log.warning("no --auth-tokens-file: the gateway accepts unauthenticated calls on %s", listen)
        if not cert:
            log.warning("no --tls-cert: calls and tokens on %s travel in plaintext", listen)
    return port
