"""Signed resume tokens: a lease the client carries, that any router replica can honour alone.

Design note. A lease (Talaria §3.3, §4.1: ``(session, model, instance, prefix, t_exp)``) normally reaches
the other router replicas through the shared JetStream bucket (``leases.py``); when that store is slow or
partitioned, a replica that has not seen the lease places the return by cost and loses the session's KV.
So every response of a session call carries ``X-Talaria-Resume-Token``: the lease the call's completion
will install (lease id = the call's request id, expiry = t_done + tau), with the caller's tenant, the
tenant-scoped session, model, instance and the instance's *engine epoch*, MACed with HMAC-SHA256 under
``router.auth.resume_secret`` (shared by the replicas; ``talaria up`` generates one per stack). A client
sends it back with its next call; a replica verifies it offline and, if its own lease table has no lease
for the session, installs the token's lease locally (revision 0: it is never consumed in the shared store,
only here, once). The policy then judges it like any lease (expiry, instance health, epoch, prefix).
Fencing: a call placed on a lease carries the lease's epoch in ``GenerateRequest.resume_epoch``; an engine
with another epoch (it restarted and lost that KV) refuses the call (``resume_fenced``) and the router
places it again without the lease. A forged, tampered, expired, other-tenant, other-session or replayed
token is ignored — normal placement — and counted (``resume_token_<outcome>``). The token is a bearer
capability for a soft reservation only: it never grants access to KV (that is scoped by tenant).

| piece | what |
|---|---|
| ``ResumeClaim`` | the signed fields |
| ``ResumeSigner`` | pure (wall clock injected): ``issue`` / ``verify`` |
| ``Resumes`` | the router's use (through ``LeaseService``): ``issue_for`` a finished call, ``apply`` a presented token to the lease table, ``consumed`` (replay guard) |
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass

from talaria.v1 import common_pb2 as cpb
from talaria.v1 import router_pb2 as rpb

log = logging.getLogger(__name__)

VERSION = 1
HEADER = "X-Talaria-Resume-Token"
_MAX_TOKEN = 4096


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s + "=" * (-len(s) % 4), altchars=b"-_", validate=True)


@dataclass(frozen=True, slots=True)
class ResumeClaim:
    tenant: str
    session_id: str  # tenant-scoped
    model: str
    instance_id: str
    epoch: int  # engine epoch of instance_id when the call ran
    lease_id: str
    committed_tokens: int
    t_done_unix: float
    t_exp_unix: float


class ResumeSigner:
    """HMAC-SHA256 tokens ``<payload>.<mac>`` (base64url). Pure; ``wall`` is the clock expiry is judged by."""

    def __init__(self, secret: bytes, wall: Callable[[], float]):
        if len(secret) < 16:
            raise ValueError("resume secret must be at least 16 bytes")
        self._key = hashlib.sha256(b"talaria-resume-v1\x00" + secret).digest()
        self.wall = wall

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def issue(self, c: ResumeClaim) -> str:
        payload = json.dumps([VERSION, *astuple(c)], separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def verify(self, token: str, tenant: str, session_id: str, model: str) -> tuple[ResumeClaim | None, str]:
        """The claim and "ok", or None and why not: "malformed" | "forged" | "expired" | "wrong_tenant" |
        "wrong_session" | "wrong_model". The MAC is checked before anything in the payload is trusted."""
        if len(token) > _MAX_TOKEN or token.count(".") != 1:
            return None, "malformed"
        p64, m64 = token.split(".")
        try:
            payload, mac = _unb64(p64), _unb64(m64)
        except (binascii.Error, ValueError):
            return None, "malformed"
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None, "forged"
        try:
            v, *fields = json.loads(payload)
            if v != VERSION:
                return None, "malformed"
            c = ResumeClaim(str(fields[0]), str(fields[1]), str(fields[2]), str(fields[3]), int(fields[4]), str(fields[5]), int(fields[6]), float(fields[7]), float(fields[8]))
        except (ValueError, TypeError, IndexError):
            return None, "malformed"
        if c.tenant != tenant:
            return None, "wrong_tenant"
        if c.session_id != session_id:
            return None, "wrong_session"
        if c.model != model:
            return None, "wrong_model"
        if self.wall() >= c.t_exp_unix:
            return None, "expired"
        return c, "ok"


class Resumes:
    """The router's resume tokens: one per process, over its lease table. Mutates the table (``apply``),
    its replay guard and ``counters``."""

    def __init__(self, signer: ResumeSigner, counters, remember: int = 65536):
        self.signer = signer
        self.counters = counters
        self._used: set[str] = set()
        self._order: deque[str] = deque()
        self._remember = remember

    @classmethod
    def from_config(cls, secret: str | None, wall: Callable[[], float], counters) -> "Resumes":
        """The router's tokens under ``router.auth.resume_secret`` (None: a random key, valid at this replica only)."""
        if secret is None:
            log.warning("router.auth.resume_secret is not set: resume tokens are valid only at this router replica")
            key = secrets.token_bytes(32)
        else:
            key = secret.encode()
        return cls(ResumeSigner(key, wall), counters)

    def issue_for(self, leases, g, instance_id: str, epoch: int, usage) -> str | None:
        """The token of a finished session call (None without a session, leases or usage). ``leases``: the
        ``LeaseService`` (whether leases are on, the lease window after a call of the model)."""
        if not g.session_id or not leases.leases_enabled or usage is None:
            return None
        now = self.signer.wall()
        committed = max(usage.prompt_tokens + usage.completion_tokens - 1, 0)  # the last sampled token has no KV yet
        c = ResumeClaim(g.tenant, g.session_id, g.model, instance_id, epoch, g.request_id, committed, now, now + leases.lease_window(g.model))
        self.counters["resume_token_issued"] += 1
        return self.signer.issue(c)

    def apply(self, token: str | None, g, leases) -> ResumeClaim | None:
        """Verify a presented token; when valid and the lease table (of ``leases``, the ``LeaseService``) has no
        newer lease of the session, install the token's lease there at revision 0 (local only). Returns the
        valid claim (or None). A token is ignored when leases are off (policy other than full, or tau 0)."""
        if not token:
            return None
        if not leases.leases_enabled:
            self.counters["resume_token_leases_off"] += 1
            return None
        table = leases.table
        if not g.session_id:
            self.counters["resume_token_wrong_session"] += 1
            return None
        c, outcome = self.signer.verify(token, g.tenant, g.session_id, g.model)
        if c is not None and c.lease_id in self._used:
            c, outcome = None, "replayed"
        self.counters[f"resume_token_{outcome}"] += 1
        if c is None:
            return None
        cur = table.get(c.session_id, c.model)
        if cur is None or cur[0].t_done_unix < c.t_done_unix:  # the store has not brought this lease (yet)
            table.upsert(lease_of(c), 0)
            self.counters["resume_token_installed"] += 1
        return c

    def consumed(self, lease_id: str) -> None:
        """A lease was honoured here: its token is not honoured again at this replica."""
        if not lease_id or lease_id in self._used:
            return
        self._used.add(lease_id)
        self._order.append(lease_id)
        while len(self._order) > self._remember:
            self._used.discard(self._order.popleft())


def lease_of(c: ResumeClaim) -> rpb.Lease:
    return rpb.Lease(
        schema_version=1, lease_id=c.lease_id, session_id=c.session_id, model=c.model, instance_id=c.instance_id,
        prefix=cpb.PrefixHandle(model=c.model, committed_tokens=c.committed_tokens), t_done_unix=c.t_done_unix,
        t_exp_unix=c.t_exp_unix, router_id="resume-token", instance_epoch=c.epoch,
    )
