"""Per-call agent hints: validation at the edge, Dynamo aliases, the wire message.

Design (Dynamo's agent hints, ``nvext.agent_hints`` / ``nvext.cache_control``; Continuum's per-tool-call KV
TTL): an agent harness knows things the server can only guess — how urgent a call is, how long its answer
will be, how long the tool it is about to run takes, how long its context is worth keeping. Each is an
optional request extra (``extra_body`` of the ``openai`` client):

======================  ===============================  ==========================================================
field (Talaria)         Dynamo alias                     used by
======================  ===============================  ==========================================================
``priority`` (int32)    ``nvext.agent_hints.priority``   engine queue order: admitted before waiting calls of lower
                                                         priority (ties: arrival); never ahead of a preempted call
``expected_output_      ``nvext.agent_hints.osl``        router pressure estimate: the call's expected decode
tokens`` (1..2^32-1)                                     tokens in ``dR_req`` (Eq. 1) instead of the model's EWMA
``expected_tool_s``     —                                carried to the hook for the lease predictor (branch
(0..86400)                                               ``lease``: ``LeaseService.lease_tau`` is the hook)
``ttft_target_s`` /     —                                per-token deadlines of a cold pool with ``token_deadlines``
``tpot_target_s``                                        (GenerateRequest; the engine's targets if absent)
(0..3600]
``cache_ttl_s``         ``nvext.cache_control.ttl`` or   upper bound of the session's lease after this call
(0..86400]              ``cache_control.ttl`` ("300",    (``LeaseService.lease_tau``)
                        "5m", "1h"; ``type: ephemeral``)
—                       ``nvext.agent_hints.latency_     engine queue order: the call queues as if it had arrived
                        sensitivity`` (seconds)          that many seconds earlier (Dynamo's meaning), within its
                                                         priority
======================  ===============================  ==========================================================

Semantics that differ from Dynamo, stated rather than hidden: larger ``priority`` = earlier (SGLang's default;
vLLM's is the reverse); Dynamo clamps ``cache_control.ttl`` to [300, 3600] s and *pins* the prefix for it,
while here it only bounds the lease (never a hard pin: SGLang reverted one for wedging memory).
``nvext.agent_hints.speculative_prefill: true`` and every other ``nvext`` field are refused with a 400 naming
the field (``false`` is accepted: it asks for nothing). The same hint given twice with different values (native
and alias) is a 400 naming the alias. Nothing is ignored silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.router.errors import APIError
from talaria.v1 import engine_pb2 as pb

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
MAX_HINT_S = 86400.0
MAX_DEADLINE_S = 3600.0  # the engine's bound for token deadline targets (executor.validate_request)
DYNAMO_DEFAULT_TTL_S = 300.0  # Dynamo's cache_control.ttl default
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class CacheControl(BaseModel):
    """Dynamo's ``cache_control`` (also Anthropic's shape): ``{"type": "ephemeral", "ttl": "5m"}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: str | int | float | None = None


class AgentHints(BaseModel):
    """Dynamo's ``nvext.agent_hints`` (field names as Dynamo documents them)."""

    model_config = ConfigDict(extra="forbid")
    priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    osl: int | None = Field(None, ge=1, le=UINT32_MAX)
    latency_sensitivity: float | None = Field(None, ge=0.0, le=MAX_HINT_S)
    speculative_prefill: bool | None = None


class NvExt(BaseModel):
    """Dynamo's ``nvext``: only the hint objects are served here; any other field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    agent_hints: AgentHints | None = None
    cache_control: CacheControl | None = None


class HintFields(BaseModel):
    """The hint fields of a request body (mixed into the chat/completion request models)."""

    priority: int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    expected_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    expected_tool_s: float | None = Field(None, ge=0.0, le=MAX_HINT_S)
    cache_ttl_s: float | None = Field(None, gt=0.0, le=MAX_HINT_S)
    # per-call token deadline targets for a cold pool scheduling by token deadlines (Aegaeon); they go
    # to GenerateRequest.ttft_target_s / tpot_target_s (the engine's configured slot_ttft_s / slot_tpot_s if absent)
    ttft_target_s: float | None = Field(None, gt=0.0, le=MAX_DEADLINE_S)
    tpot_target_s: float | None = Field(None, gt=0.0, le=MAX_DEADLINE_S)
    nvext: NvExt | None = None
    cache_control: CacheControl | None = None

    def hints(self) -> "CallHints":
        return resolve(self)


@dataclass(frozen=True, slots=True)
class CallHints:
    """The resolved hints of one call (None = not given)."""

    priority: int | None = None
    expected_output_tokens: int | None = None
    expected_tool_s: float | None = None
    cache_ttl_s: float | None = None
    latency_sensitivity_s: float | None = None

    def proto(self) -> pb.AgentCallHints | None:
        """The wire message, or None when no hint was given (the field stays unset)."""
        if self == CallHints():
            return None
        m = pb.AgentCallHints(
            expected_output_tokens=self.expected_output_tokens or 0, expected_tool_s=self.expected_tool_s or 0.0,
            cache_ttl_s=self.cache_ttl_s or 0.0, latency_sensitivity_s=self.latency_sensitivity_s or 0.0,
        )
        if self.priority is not None:
            m.has_priority, m.priority = True, self.priority
        return m


def parse_ttl(v: str | int | float | None, param: str) -> float | None:
    """``"300"``, ``"5m"``, ``"1h"``, ``300`` -> seconds in (0, 86400]; anything else is a 400 naming ``param``."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise APIError(400, f"'{param}' must be seconds or a duration such as \"5m\"", code="invalid_value", param=param)
    if isinstance(v, (int, float)):
        s = float(v)
    else:
        m = _TTL.match(v)
        if m is None:
            raise APIError(400, f"'{param}' must be seconds or a duration such as \"5m\" or \"1h\", got {v!r}", code="invalid_value", param=param)
        s = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not 0.0 < s <= MAX_HINT_S:
        raise APIError(400, f"'{param}' must be within (0, {MAX_HINT_S:.0f}] seconds, got {s:g}", code="invalid_value", param=param)
    return s


def _ttl_of(cc: CacheControl | None, param: str) -> float | None:
    if cc is None:
        return None
    return DYNAMO_DEFAULT_TTL_S if cc.ttl is None else parse_ttl(cc.ttl, param)


def _merge(name: str, native: Any, alias: Any, alias_param: str) -> Any:
    if native is not None and alias is not None and native != alias:
        raise APIError(400, f"'{alias_param}' ({alias!r}) contradicts '{name}' ({native!r}): send one", code="invalid_value", param=alias_param)
    return native if native is not None else alias


def resolve(req: HintFields) -> CallHints:
    """Native fields and Dynamo aliases -> one :class:`CallHints`; raises :class:`APIError` (400 naming the
    field) for a refused or contradictory value."""
    nv = req.nvext or NvExt()
    ah = nv.agent_hints or AgentHints()
    if ah.speculative_prefill:
        raise APIError(400, "speculative prefill is not supported", code="unsupported_parameter", param="nvext.agent_hints.speculative_prefill")
    ttl = _ttl_of(req.cache_control, "cache_control.ttl")
    nv_ttl = _ttl_of(nv.cache_control, "nvext.cache_control.ttl")
    ttl = _merge("cache_ttl_s", req.cache_ttl_s, ttl, "cache_control.ttl")
    ttl = _merge("cache_ttl_s", ttl, nv_ttl, "nvext.cache_control.ttl")
    return CallHints(
        priority=_merge("priority", req.priority, ah.priority, "nvext.agent_hints.priority"),
        expected_output_tokens=_merge("expected_output_tokens", req.expected_output_tokens, ah.osl, "nvext.agent_hints.osl"),
        expected_tool_s=req.expected_tool_s,
        cache_ttl_s=ttl,
        latency_sensitivity_s=ah.latency_sensitivity,
    )


__all__ = ["AgentHints", "CacheControl", "CallHints", "HintFields", "NvExt", "parse_ttl", "resolve"]
