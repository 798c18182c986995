"""Who may call the kvstore: a shared bearer token and/or mutual TLS, from ``KvStoreConfig``.

Design note. The store holds every tenant's KV and hands out pool addresses; only engines of the stack may
use it. Two mechanisms, either or both by config: ``auth_token`` — each control RPC carries
``authorization: Bearer <token>`` metadata, compared in constant time by a server interceptor that answers
UNAUTHENTICATED otherwise (the health service stays open for probes; it reveals nothing) — and
``tls_cert_file``/``tls_key_file``/``tls_ca_file`` — the gRPC port is TLS, and with a CA client certificates
signed by it are required (mTLS). Neither set: an open store, as before (it binds loopback by default).
``talaria up`` generates a token per stack. The token is never logged or put in a span (the server's
trace extraction reads only ``traceparent``/``tracestate``). The Mooncake data plane itself has no
authentication; it moves bytes only to addresses a control RPC handed out.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
_OPEN_PREFIX = "/grpc.health."


def call_metadata(token: str | None) -> list[tuple[str, str]]:
    """The metadata a client adds to each call (empty without a token)."""
    return [(METADATA_KEY, f"Bearer {token}")] if token else []


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call but health checks unless it carries the bearer token. Mutates ``refused``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self.refused = 0

        def deny(_req, ctx):
            ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "kvstore: missing or wrong credentials")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN_PREFIX):
            return continuation(details)
        for k, v in details.invocation_metadata or ():
            if k == METADATA_KEY and hmac.compare_digest(v.encode() if isinstance(v, str) else v, self._expected):
                return continuation(details)
        self.refused += 1
        log.warning("kvstore refused an unauthenticated call to %s", details.method)
        return self._deny


def server_interceptors(cfg) -> list[grpc.ServerInterceptor]:
    return [TokenInterceptor(cfg.auth_token)] if cfg.auth_token else []


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cfg) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port (mTLS when ``tls_ca_file`` is set), or None for a plaintext port."""
    if not cfg.tls_cert_file:
        return None
    if not cfg.tls_key_file:
        raise ValueError("kvstore.tls_cert_file needs kvstore.tls_key_file")
    ca = _read(cfg.tls_ca_file)
    return grpc.ssl_server_credentials([(_read(cfg.tls_key_file), _read(cfg.tls_cert_file))], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(cfg) -> grpc.ChannelCredentials | None:
    """Client side: TLS to a store whose certificate ``tls_ca_file`` signs, presenting our certificate."""
    if not cfg.tls_ca_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(cfg.tls_ca_file), private_key=_read(cfg.tls_key_file), certificate_chain=_read(cfg.tls_cert_file))
