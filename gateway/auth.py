"""Authentication of callers by bearer token or client certificate, each naming a tenant with
its limits and role.

The tenants file (`--auth-tokens-file`); every key optional but `tokens` or
`client_identities` (at least one of the two non-empty):

    {"tenants": {"acme": {"tokens": ["..."], "client_identities": ["CN=svc-a", "DNS:svc-a.corp",
                                                                   "URI:spiffe://corp/ns/a/sa/b"],
                          "max_concurrent": 8, "tokens_per_minute": 60000,
                          "max_priority": 0, "admin": false, "share_prefix_cache": ["acme-eu"]}}}

max_concurrent and tokens_per_minute (>= 1) are enforced across gateways through Redis
(gateway/quotas.py). max_priority caps GenerateRequest.priority: absent means 0 (no
tenant may ask for the high class unless the operator says so), `null` means no cap.
admin: the tenant sees the whole GetServerInfo (workers, hosts, KV and prefix-cache
counters); others see the version, the queue depth and their own limits.
share_prefix_cache: the tenants whose cached prompt blocks this one may reuse, and that
may reuse its own. Sharing must be mutual and transitive (the lists form groups: A lists
B exactly when B lists A, and a group's members all list each other), so each tenant has
one cache scope, its group; by default a tenant is a group of one and no other tenant can
learn from cached_prompt_tokens or the time to first token what it sent.
client_identities (mTLS, --tls-client-ca): a call whose client certificate presents one of
them is the tenant's without a token. `CN=<name>` is the certificate subject's common name;
`DNS:<name>` (any case), `URI:<uri>` and `email:<address>` are subject alternative names;
a bare `spiffe://...` is short for `URI:spiffe://...`. Each is matched exactly, never as a
pattern, against what gRPC verified (`context.auth_context()`); there is no wildcard. The
--tls-client-ca CAs decide which names a client can present: they must sign for these clients only.
The file is checked strictly: anything unknown, a token or an identity in two places, a
limit < 1, a one-sided share, client_identities on a gateway without --tls-client-ca (no
client certificate would ever be asked for, so none could be verified) stop the process at
start-up; on SIGHUP a bad new file is logged and the old one kept.

Callers send the metadata `authorization: Bearer <token>`, or a client certificate bound to
a tenant, or both. The token is compared with every known token (constant time each, no
early exit at the first match) over their SHA-256 digests, so neither which token matched
nor its length shows in the timing; identities are no secret and are looked up directly.
A call is refused UNAUTHENTICATED when it has neither, when its token is not valid (a bound
certificate does not excuse a bad token), when its certificate's identities are bound to
two tenants, or when its certificate and its token name different tenants.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # it becomes part of Redis keys and a metric label
MIN_TOKEN_CHARS = 16
LIMITS = ("max_concurrent", "tokens_per_minute")  # >= 1 each
TENANT_FIELDS = frozenset({"tokens", "client_identities", "max_priority", "admin", "share_prefix_cache",
                           *LIMITS})
DEFAULT_MAX_PRIORITY = 0  # a tenant whose entry names no max_priority: normal and low classes only
BEARER = "bearer "
# client_identities prefix -> the auth-context property of a verified client certificate it names
IDENTITY_PROPERTIES = {"CN=": "x509_common_name", "DNS:": "peer_dns", "URI:": "peer_uri",
                       "email:": "peer_email"}
SPIFFE = "spiffe://"  # a bare SPIFFE ID is short for URI:spiffe://...
MAX_IDENTITIES_SHOWN = 4  # of a refused certificate, in the error message
AuthContext = Mapping[str, Sequence[bytes]]  # grpc's ServicerContext.auth_context()


class Unauthenticated(GatewayError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(GatewayError):
    code = grpc.StatusCode.PERMISSION_DENIED


@dataclass(frozen=True)
class Tenant:
    """Who a call is billed to, its limits (None = unlimited), its role and its cache scope."""

    name: str
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    max_priority: int | None = None
    is_admin: bool = False
    cache_group: str = ""  # tenants with the same group share cached prompt blocks

    def cache_scope(self, cache_salt: str = "") -> bytes:
        """QueuedRequest.cache_scope: equal only for requests that may share cached blocks."""
        if not self.cache_group and not cache_salt:
            return b""
        return f"{self.cache_group}\0{cache_salt}".encode()

    def check_priority(self, priority: int) -> None:
        if self.max_priority is not None and priority > self.max_priority:
            raise PermissionDenied(f"priority {priority} is above the max_priority of tenant "
                                   f"{self.name!r} ({self.max_priority})")


# Every call when authentication is off: one trusted tenant, no caps, sees everything.
ANONYMOUS = Tenant("", is_admin=True)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def normalize_identity(identity: str) -> str:
    """client_identities' spelling of one identity (a bare SPIFFE ID gets its `URI:`, a DNS
    name is lower case); ValueError unless it is `CN=`, `DNS:`, `URI:` or `email:` + a value."""
    if identity.startswith(SPIFFE):
        identity = "URI:" + identity
    kind = next((k for k in IDENTITY_PROPERTIES if identity.startswith(k)), None)
    value = identity[len(kind):] if kind else ""
    if kind is None or not value or value != value.strip() or not value.isprintable():
        raise ValueError(f"{identity!r} is not CN=<common name>, DNS:<name>, URI:<uri>, "
                         "email:<address> or spiffe://...")
    return kind + value.lower() if kind == "DNS:" else identity


def peer_identities(auth_context: AuthContext | None) -> frozenset[str]:
    """The identities (spelt as in client_identities) of the call's client certificate, as
    gRPC verified it against --tls-client-ca; empty without one."""
    if not auth_context or list(auth_context.get("transport_security_type", ())) != [b"ssl"]:
        return frozenset()
    found = set()
    for kind, name in IDENTITY_PROPERTIES.items():
        for value in auth_context.get(name, ()):
            try:
                text = value.decode()
            except UnicodeDecodeError:  # matches no identity a tenants file can spell
                continue
            found.add(kind + text.lower() if kind == "DNS:" else kind + text)
    return frozenset(found)


class Tenants:
    """The parsed tenants file: token digest -> tenant, client identity -> tenant."""

    def __init__(self, tokens: Iterable[tuple[str, Tenant]],
                 identities: Mapping[str, Tenant] | None = None) -> None:
        self._tokens = [(_digest(token), tenant) for token, tenant in tokens]
        self._identities = dict(identities or {})

    def find(self, token: str) -> Tenant | None:
        candidate, found = _digest(token), None
        for known, tenant in self._tokens:  # all of them: the time does not depend on which matched
            if hmac.compare_digest(candidate, known):
                found = tenant
        return found

    def find_identity(self, identities: Iterable[str]) -> Tenant | None:
        """The tenant the certificate's identities are bound to; Unauthenticated if two tenants."""
        bound = {identity: self._identities[identity] for identity in sorted(identities)
                 if identity in self._identities}
        if len({tenant.name for tenant in bound.values()}) > 1:
            named = ", ".join(f"{identity!r} to tenant {tenant.name!r}" for identity, tenant in bound.items())
            raise Unauthenticated(f"the client certificate is bound to more than one tenant ({named}): "
                                  "an identity may name one tenant only")
        return next(iter(bound.values()), None)

    @property
    def has_identities(self) -> bool:
        return bool(self._identities)

    def __len__(self) -> int:
        return len({tenant.name for _, tenant in self._tokens} | {t.name for t in self._identities.values()})


def _strings(where: str, entry: dict[str, object], key: str, what: str = "strings") -> list[str]:
    """entry[key]: a list of strings, [] if absent; ValueError otherwise."""
    values = entry.get(key, [])
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{where}: {key} must be a list of {what}")
    return values


def _credentials(where: str, entry: dict[str, object]) -> tuple[list[str], list[str]]:
    """The entry's tokens and its (normalized) client identities, at least one of them."""
    tokens, identities = entry.get("tokens", []), entry.get("client_identities", [])
    if not isinstance(tokens, list) or not isinstance(identities, list) or not (tokens or identities):
        raise ValueError(f"{where}: \"tokens\" must be a non-empty list of strings, or \"client_identities\" "
                         "a non-empty list of client-certificate identities (or both)")
    for i, token in enumerate(_strings(where, entry, "tokens")):
        if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ValueError(f"{where}: tokens[{i}] must be a string of at least {MIN_TOKEN_CHARS} "
                             "characters without spaces")
    normalized = []
    for i, identity in enumerate(_strings(where, entry, "client_identities")):
        try:
            normalized.append(normalize_identity(identity))
        except ValueError as e:
            raise ValueError(f"{where}: client_identities[{i}] {e}") from None
    return tokens, normalized


def _tenant(path: str, name: str, entry: object) -> tuple[Tenant, list[str], list[str]]:
    where = f"{path}: tenant {name!r}"
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{path}: tenant name {name!r} must be 1-64 characters of [A-Za-z0-9._-]")
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with \"tokens\" or \"client_identities\"")
    if unknown := sorted(set(entry) - TENANT_FIELDS):
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(TENANT_FIELDS))}")
    tokens, identities = _credentials(where, entry)
    for field in (*LIMITS, "max_priority"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}: {field} must be an integer, got {value!r}")
        if field in LIMITS and value is not None and value < 1:
            raise ValueError(f"{where}: {field} must be >= 1, got {value}")
    if not isinstance(entry.get("admin", False), bool):
        raise ValueError(f"{where}: admin must be true or false, got {entry['admin']!r}")
    _strings(where, entry, "share_prefix_cache", "tenant names")
    tenant = Tenant(name, entry.get("max_concurrent"), entry.get("tokens_per_minute"),
                    entry.get("max_priority", DEFAULT_MAX_PRIORITY), entry.get("admin", False))
    return tenant, tokens, identities
def _cache_groups(path: str, shares: dict[str, set[str]]) -> dict[str, str]:
    """tenant -> its cache group (the group's first name in sorted order); ValueError unless
    every share_prefix_cache list is mutual and the lists form groups."""
    groups: dict[str, str] = {}
    for name, listed in shares.items():
        if unknown := sorted(listed - set(shares)):
            raise ValueError(f"{path}: tenant {name!r} share_prefix_cache names unknown tenant(s) "
                             f"{', '.join(map(repr, unknown))}")
        group = listed | {name}
        for other in sorted(group - {name}):
            if shares[other] | {other} != group:
                raise ValueError(f"{path}: tenants {name!r} and {other!r} share the prefix cache but list "
                                 "different tenants: sharing must be mutual, and every tenant of a group "
                                 "must list all the others")
        groups[name] = min(group) if listed else name
    return groups


def load_tenants(path: str, *, can_verify_client_certs: bool = False) -> Tenants:
    """Parse and check the tenants file; ValueError naming the first problem.
    can_verify_client_certs: the gateway asks for client certificates (--tls-client-ca), so
    client_identities can be verified; without it a file that has some is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"auth_tokens_file {path!r} cannot be read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"auth_tokens_file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise ValueError(f"{path}: the file must be one object {{\"tenants\": {{NAME: {{...}}}}}} and "
                         f"nothing else, got keys {sorted(data) if isinstance(data, dict) else type(data)}")
    if not data["tenants"]:
        raise ValueError(f"{path}: no tenants: every call would be refused")
    parsed = [(name, *_tenant(path, name, entry)) for name, entry in data["tenants"].items()]
    groups = _cache_groups(path, {name: set(data["tenants"][name].get("share_prefix_cache", []))
                                  for name, *_ in parsed})
    owner: dict[str, str] = {}
    pairs: list[tuple[str, Tenant]] = []
    bound: dict[str, Tenant] = {}
    for name, tenant, tokens, identities in parsed:
        tenant = dataclasses.replace(tenant, cache_group=groups[name])
        for i, token in enumerate(tokens):
            if token in owner:  # the token itself is never printed
                raise ValueError(f"{path}: tenant {name!r} tokens[{i}] is also a token of tenant "
                                 f"{owner[token]!r}: a token names one tenant")
            owner[token] = name
            pairs.append((token, tenant))
        for i, identity in enumerate(identities):
            if identity in bound:
                raise ValueError(f"{path}: tenant {name!r} client_identities[{i}] {identity!r} is also bound "
                                 f"to tenant {bound[identity].name!r}: an identity names one tenant")
            bound[identity] = tenant
        if identities and not can_verify_client_certs:
            raise ValueError(f"{path}: tenant {name!r} has client_identities, but the gateway has no "
                             "--tls-client-ca: it asks for no client certificate, so they could never be "
                             "verified (set --tls-client-ca, or remove client_identities)")
    return Tenants(pairs, bound)


class Authenticator:
    """The current tenants of `path`; reload() swaps them (calls already admitted keep theirs).
    can_verify_client_certs: see load_tenants."""

    def __init__(self, path: str, *, can_verify_client_certs: bool = False) -> None:
        self.path = path
        self.can_verify_client_certs = can_verify_client_certs
        self.tenants = load_tenants(path, can_verify_client_certs=can_verify_client_certs)

    def reload(self) -> bool:
        try:
            tenants = load_tenants(self.path, can_verify_client_certs=self.can_verify_client_certs)
        except ValueError as e:
            log.error("tenants file not reloaded, the previous one stays in force: %s", e)
            return False
        self.tenants = tenants  # one assignment: a call sees the old or the new file, never half
        log.info("tenants file %s reloaded: %d tenant(s)", self.path, len(tenants))
        return True

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None,
                     auth_context: AuthContext | None = None) -> Tenant:
        """The tenant of the call's `authorization: Bearer <token>` and/or of its client
        certificate (auth_context: the peer's, as gRPC verified it); Unauthenticated unless
        exactly one tenant is named."""
        tenants = self.tenants  # one file for the whole call, even if a reload swaps it meanwhile
        identities = peer_identities(auth_context) if self.can_verify_client_certs else frozenset()
        by_cert = tenants.find_identity(identities)
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            if by_cert is not None:
                return by_cert
            raise Unauthenticated(_no_credentials(identities, tenants.has_identities))
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if len(values) > 1 or not value.lower().startswith(BEARER):
            raise Unauthenticated("the authorization metadata must be one 'Bearer <token>'")
        by_token = tenants.find(value[len(BEARER):].strip())
        if by_token is None:
            raise Unauthenticated("the bearer token is not valid")
        if by_cert is not None and by_cert.name != by_token.name:
            raise Unauthenticated(f"the client certificate is bound to tenant {by_cert.name!r} but the "
                                  f"bearer token names tenant {by_token.name!r}: send one tenant's "
                                  "credentials")
        return by_token


def _no_credentials(identities: frozenset[str], has_identities: bool) -> str:
    if not has_identities:
        return "no authorization metadata: send 'authorization: Bearer <token>'"
    if not identities:
        return ("no authorization metadata and no client certificate: send 'authorization: Bearer <token>' "
                "or a client certificate bound to a tenant")
    shown = sorted(identities)[:MAX_IDENTITIES_SHOWN]
    more = f" and {len(identities) - len(shown)} more" if len(identities) > len(shown) else ""
    return (f"no authorization metadata, and the client certificate ({', '.join(shown)}{more}) is bound to "
            "no tenant: send 'authorization: Bearer <token>' or a certificate named in a tenant's "
            "client_identities")
