"""Bearer-token authentication of callers, each token naming a tenant with its limits and role.

The tenants file (`--auth-tokens-file`), every key but `tokens` optional:

    {"tenants": {"acme": {"tokens": ["..."], "max_concurrent": 8, "tokens_per_minute": 60000,
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
learn from cached_prompt_tokens or the time to first token what it sent. The file is
checked strictly: anything unknown, a token in two places, a limit < 1, a one-sided share
stop the process at start-up; on SIGHUP a bad new file is logged and the old one kept.

Callers send the metadata `authorization: Bearer <token>`. The token is compared with
every known token (constant time each, no early exit at the first match) over their
SHA-256 digests, so neither which token matched nor its length shows in the timing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # it becomes part of Redis keys and a metric label
MIN_TOKEN_CHARS = 16
LIMITS = ("max_concurrent", "tokens_per_minute")  # >= 1 each
TENANT_FIELDS = frozenset({"tokens", "max_priority", "admin", "share_prefix_cache", *LIMITS})
DEFAULT_MAX_PRIORITY = 0  # a tenant whose entry names no max_priority: normal and low classes only
BEARER = "bearer "


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


class Tenants:
    """The parsed tenants file: token digest -> tenant."""

    def __init__(self, tokens: Iterable[tuple[str, Tenant]]) -> None:
        self._tokens = [(_digest(token), tenant) for token, tenant in tokens]

    def find(self, token: str) -> Tenant | None:
        candidate, found = _digest(token), None
        for known, tenant in self._tokens:  # all of them: the time does not depend on which matched
            if hmac.compare_digest(candidate, known):
                found = tenant
        return found

    def __len__(self) -> int:
        return len({tenant.name for _, tenant in self._tokens})


def _tenant(path: str, name: str, entry: object) -> tuple[Tenant, list[str]]:
    where = f"{path}: tenant {name!r}"
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{path}: tenant name {name!r} must be 1-64 characters of [A-Za-z0-9._-]")
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with \"tokens\"")
    if unknown := sorted(set(entry) - TENANT_FIELDS):
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(TENANT_FIELDS))}")
    tokens = entry.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where}: \"tokens\" must be a non-empty list of strings")
    for i, token in enumerate(tokens):
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ValueError(f"{where}: tokens[{i}] must be a string of at least {MIN_TOKEN_CHARS} "
                             "characters without spaces")
    for field in (*LIMITS, "max_priority"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}: {field} must be an integer, got {value!r}")
        if field in LIMITS and value is not None and value < 1:
            raise ValueError(f"{where}: {field} must be >= 1, got {value}")
    if not isinstance(entry.get("admin", False), bool):
        raise ValueError(f"{where}: admin must be true or false, got {entry['admin']!r}")
    shares = entry.get("share_prefix_cache", [])
    if not isinstance(shares, list) or not all(isinstance(t, str) for t in shares):
        raise ValueError(f"{where}: share_prefix_cache must be a list of tenant names")
    return Tenant(name, entry.get("max_concurrent"), entry.get("tokens_per_minute"),
                  entry.get("max_priority", DEFAULT_MAX_PRIORITY), entry.get("admin", False)), tokens


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


def load_tenants(path: str) -> Tenants:
    """Parse and check the tenants file; ValueError naming the first problem."""
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
                                  for name, _, _ in parsed})
    owner: dict[str, str] = {}
    pairs = []
    for name, tenant, tokens in parsed:
        tenant = dataclasses.replace(tenant, cache_group=groups[name])
        for i, token in enumerate(tokens):
            if token in owner:  # the token itself is never printed
                raise ValueError(f"{path}: tenant {name!r} tokens[{i}] is also a token of tenant "
                                 f"{owner[token]!r}: a token names one tenant")
            owner[token] = name
            pairs.append((token, tenant))
    return Tenants(pairs)


class Authenticator:
    """The current tenants of `path`; reload() swaps them (calls already admitted keep theirs)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tenants = load_tenants(path)

    def reload(self) -> bool:
        try:
            tenants = load_tenants(self.path)
        except ValueError as e:
            log.error("tenants file not reloaded, the previous one stays in force: %s", e)
            return False
        self.tenants = tenants  # one assignment: a call sees the old or the new file, never half
        log.info("tenants file %s reloaded: %d tenant(s)", self.path, len(tenants))
        return True

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant of the call's `authorization: Bearer <token>`; Unauthenticated otherwise."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            raise Unauthenticated("no authorization metadata: send 'authorization: Bearer <token>'")
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        if len(values) > 1 or not value.lower().startswith(BEARER):
            raise Unauthenticated("the authorization metadata must be one 'Bearer <token>'")
        tenant = self.tenants.find(value[len(BEARER):].strip())
        if tenant is None:
            raise Unauthenticated("the bearer token is not valid")
        return tenant
