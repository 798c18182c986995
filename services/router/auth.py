"""Who may call the router, and as whom: API keys, tenants, model allow-lists, per-key rate limits.

Design note. Keys are bearer secrets like OpenAI's (``Authorization: Bearer <key>``). The config stores only
their SHA-256 (``router.auth.api_keys[].sha256``); a presented key is hashed and looked up, so the key itself
is never kept, logged, traced or echoed in an error body (logs name a key by ``key_id``, the first 8 hex
digits of its hash). Each key acts for one *tenant*; the tenant scopes everything the router derives from a
session id (``scope_session``: leases, the session table, completion hooks, the engine's session cache and
the kvstore's entries all see ``<tenant>|<session>``), and the engine salts the tenant's prefix hashes with a
salt it derives from the tenant name (``talaria.hashing.tenant_salt``) — never from anything the client sends —
so two tenants never share KV and a cross-tenant timing probe is always a miss (the CVE-2025-46570 side
channel; a client-supplied salt would not close it). With no keys configured the router is open: every call
is tenant ``""``, session ids and hashes are exactly as before.

| piece | what |
|---|---|
| ``KeyRing`` | pure: hash -> ``Principal``; ``authenticate`` (401), ``admit`` (rate limit, 429), ``authorize_model`` (403) |
| ``TokenBucket`` | pure, clock injected: one per rate-limited key |
| ``AuthMiddleware`` | ASGI: checks every HTTP call before any handler runs; puts the ``Principal`` in ``request.state`` |
| ``install`` / ``principal_of`` | the two lines ``create_app`` needs |
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.router.errors import APIError, anthropic_path

log = logging.getLogger(__name__)

TENANT_SEP = "|"  # never in a tenant name (talaria.subjects.check_token), so "<tenant>|<session>" parses uniquely
# open when ``open_health``: liveness, readiness and aggregate counters (``/metrics``: Prometheus scrapes it). ``/router/decisions`` is not among
# them: it names sessions (of every tenant), so with keys configured it always needs one.
OPEN_PATHS = ("/health", "/ready", "/router/metrics", "/metrics")


def key_hash(key: str) -> str:
    """Hex SHA-256 of an API key: what the config stores (keys are random secrets, so a fast hash suffices)."""
    return hashlib.sha256(key.encode()).hexdigest()


def scope_session(tenant: str, session_id: str) -> str:
    """The session id every component sees: tenant-qualified when the call has a tenant (and a session)."""
    return f"{tenant}{TENANT_SEP}{session_id}" if tenant and session_id else session_id


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the key's tenant, a loggable key id, and the models it may call (None = all)."""

    tenant: str
    key_id: str = ""
    models: frozenset[str] | None = None


OPEN = Principal("")  # no keys configured


@dataclass(slots=True)
class TokenBucket:
    """``rate_per_s`` refill, ``burst`` capacity. Mutated by ``take``."""

    rate_per_s: float
    burst: float
    tokens: float = field(default=-1.0)
    t_last: float = field(default=math.nan)

    def take(self, now: float) -> float:
        """Take one token; returns 0.0 if granted, else the seconds until one is available (nothing taken)."""
        if self.tokens < 0:
            self.tokens, self.t_last = self.burst, now
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.t_last) * self.rate_per_s)
        self.t_last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class KeyRing:
    """API keys from ``router.auth``; pure apart from the rate limiters' state (clock injected)."""

    def __init__(self, api_keys: Iterable, clock: Callable[[], float]):
        self.clock = clock
        self._by_hash: dict[str, Principal] = {}
        self._buckets: dict[str, TokenBucket] = {}
        for k in api_keys:
            models = frozenset(k.models) if k.models is not None else None
            self._by_hash[k.sha256] = Principal(k.tenant, k.sha256[:8], models)
            if k.rate_limit_rpm:
                rate = k.rate_limit_rpm / 60.0
                self._buckets[k.sha256[:8]] = TokenBucket(rate, max(1.0, k.rate_limit_rpm / 6.0))

    @property
    def enabled(self) -> bool:
        return bool(self._by_hash)

    def tenants(self) -> list[str]:
        return sorted({p.tenant for p in self._by_hash.values()})

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header value; ``APIError(401)`` when missing or unknown."""
        if not self.enabled:
            return OPEN
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", code="missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key")
        p = self._by_hash.get(key_hash(key))
        if p is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return p

    def admit(self, p: Principal) -> None:
        """Charge one call to the key's rate limit; ``APIError(429)`` with ``Retry-After`` when over it."""
        bucket = self._buckets.get(p.key_id)
        if bucket is None:
            return
        wait = bucket.take(self.clock())
        if wait > 0:
            retry = str(max(1, math.ceil(wait)))
            raise APIError(429, "rate limit of this API key exceeded", code="rate_limit_exceeded", headers={"Retry-After": retry})

    @staticmethod
    def authorize_model(p: Principal, model: str) -> None:
        """``APIError(403)`` when the key may not call ``model``."""
        if p.models is not None and model not in p.models:
            raise APIError(403, f"this API key is not allowed to use model '{model}'", code="model_not_allowed", param="model")


class AuthMiddleware:
    """ASGI middleware: every HTTP call is authenticated (and rate-limited) before routing, except the
    open paths. On success ``scope["state"]["principal"]`` holds the caller; on failure the OpenAI error
    body is sent and the app never sees the call. Mutates ``counters`` (``auth_<status>``)."""

    def __init__(self, app, keyring: KeyRing, open_paths: tuple[str, ...], counters) -> None:
        self.app = app
        self.keyring = keyring
        self.open_paths = open_paths
        self.counters = counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        principal = OPEN
        if self.keyring.enabled and scope.get("path", "") not in self.open_paths:
            auth = api_key = None
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    auth = v.decode("latin-1")
                elif k == b"x-api-key":  # Anthropic's clients send the key here
                    api_key = v.decode("latin-1").strip()
            if auth is None and api_key:
                auth = f"Bearer {api_key}"
            try:
                principal = self.keyring.authenticate(auth)
                self.keyring.admit(principal)
            except APIError as e:
                self.counters[f"auth_{e.status}"] += 1
                await e.response(anthropic_path(scope.get("path", "")))(scope, receive, send)
                return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def install(app, state) -> KeyRing:
    """Put ``AuthMiddleware`` in front of ``app`` from ``state.cfg.router.auth``; says at start whether the
    router is open. Returns the key ring (also stored as ``state.keyring``)."""
    ac = state.cfg.router.auth
    keyring = KeyRing(ac.api_keys, state.gateway.registry.clock.now)
    open_paths = OPEN_PATHS if ac.open_health else ()
    app.add_middleware(AuthMiddleware, keyring=keyring, open_paths=open_paths, counters=state.counters)
    if keyring.enabled:
        log.info("router API keys: %d key(s) for tenants %s; open paths: %s", len(keyring._by_hash), keyring.tenants(), list(open_paths) or "none")
    else:
        log.warning("router has no API keys configured: the API is open to anyone who can reach it")
    state.keyring = keyring
    return keyring


def principal_of(request) -> Principal:
    """The caller ``AuthMiddleware`` authenticated (``OPEN`` when the app runs without it)."""
    return getattr(request.state, "principal", OPEN)
