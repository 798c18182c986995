"""Explicit end of an agent session: ``DELETE /v1/sessions/{id}`` and ``X-Session-End: true``.

Design (Dynamo's session close hint; SGLang's lesson that retention must be releasable): a session's KV is
kept on speculation — a lease on the router, the session entry and radix pages on the engine, checkpointed
pages in the host store — until something decays it. When the agent knows it is done, it says so and all of
it goes at once:

* ``X-Session-End: true`` on the last call: ``GenerateRequest.end_session``; the engine ends the session after
  that call (or after the last of its in-flight calls) and its ``CompletionHook`` says ``session_ended``, so
  every router replica drops the session's leases and installs none.
* ``DELETE /v1/sessions/{id}`` (authenticated like every route; the tenant of the key scopes the id, so a tenant
  ends only its own sessions): this replica deletes the session's leases from the shared bucket (every
  replica's mirror follows) and its table entry, then sends ``CONTROL_END_SESSION`` to the instances its session
  table and leases name, or to every live instance when it knows none (another replica placed the session).
  An engine with a call of the session in flight ends it after that call.

On the engine the end drops the session-cache entry and the radix pages of the session's chain that nothing
else extends, and releases the same chain in the kvstore (``Release`` with ``leaves_only``: shared prefixes
stay). Idempotent: ending an unknown or ended session succeeds and frees nothing.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.router import auth
from services.router.errors import APIError
from talaria.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

SESSION_END_HEADER = "x-session-end"
CONTROL_TIMEOUT_S = 5.0
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


def session_end_header(value: str | None, session_id: str) -> bool:
    """``X-Session-End`` -> whether the call ends its session; 400 naming the header for a bad value or for
    an end without a session id (nothing to end)."""
    if value is None:
        return False
    v = value.strip().lower()
    if v not in _TRUE + _FALSE:
        raise APIError(400, f"X-Session-End must be true or false, got {value!r}", code="invalid_value", param="X-Session-End")
    if v in _TRUE and not session_id:
        raise APIError(400, "X-Session-End needs a session (X-Session-ID header or session_id)", code="missing_field", param="X-Session-End")
    return v in _TRUE


async def _end_on(state, instance_id: str, req: pb.ControlRequest) -> bool:
    """One instance's CONTROL_END_SESSION; False when it did not answer ok."""
    try:
        msg = await state.nc.request(state.subjects.control(instance_id), req.SerializeToString(), timeout=CONTROL_TIMEOUT_S)
        reply = pb.ControlReply.FromString(msg.data)
    except Exception as e:  # noqa: BLE001 - an unreachable engine loses the KV with its process anyway
        log.warning("end of session %s not confirmed by %s: %s", req.session_id, instance_id, e)
        return False
    if not reply.ok:
        log.warning("instance %s refused to end session %s: %s", instance_id, req.session_id, reply.error.message)
    return reply.ok


async def end_session(state, session_id: str, tenant: str) -> dict:
    """Drop the session's leases and table entry here, then end it on the instances that hold it (every live
    instance when none is known). Mutates the lease store, the gateway's tables, counters."""
    scoped = auth.scope_session(tenant, session_id)
    await state.lease_store.drop_session(scoped, sorted(state.registry.models()))
    holders = state.gateway.end_session(scoped)
    reg = state.registry
    targets = holders or [iid for iid, v in reg.instances.items() if reg.alive(v)]
    req = pb.ControlRequest(schema_version=1, op=pb.CONTROL_END_SESSION, session_id=scoped, tenant=tenant)
    oks = await asyncio.gather(*(_end_on(state, iid, req) for iid in targets)) if state.nc is not None else []
    state.counters["sessions_ended"] += 1
    return {
        "id": session_id, "object": "session.deleted", "deleted": True,
        "instances": [iid for iid, ok in zip(targets, oks) if ok],
        "unconfirmed": [iid for iid, ok in zip(targets, oks) if not ok],
        "broadcast": not holders,
    }


def session_routes(state) -> APIRouter:
    router = APIRouter()

    @router.delete("/v1/sessions/{session_id:path}")  # any id, slashes included
    async def delete_session(session_id: str, request: Request) -> JSONResponse:
        if not 0 < len(session_id) <= 256:
            raise APIError(400, "session id must be 1..256 characters", code="invalid_value", param="session_id")
        try:
            session_id.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "session id is not valid Unicode", code="invalid_value", param="session_id") from None
        principal = auth.principal_of(request)  # the key's tenant scopes the id: a tenant ends only its own
        return JSONResponse(await end_session(state, session_id, principal.tenant))

    return router


__all__ = ["SESSION_END_HEADER", "end_session", "session_end_header", "session_routes"]
