"""Per-call agent hints: span attribute names shared by the router and the engine.

The router validates the hints at the edge (``services/router/hints.py``) and sends them as
``GenerateRequest.hints`` (``AgentCallHints``); the engine echoes them in its ``CompletionHook`` so that every
router replica sizes the session's lease alike. Both sides record them on their call spans with these names.
"""

from __future__ import annotations

from typing import Any

HINT_PRIORITY = "talaria.hint.priority"
HINT_EXPECTED_OUTPUT_TOKENS = "talaria.hint.expected_output_tokens"
HINT_EXPECTED_TOOL_S = "talaria.hint.expected_tool_s"
HINT_CACHE_TTL_S = "talaria.hint.cache_ttl_s"
HINT_LATENCY_SENSITIVITY_S = "talaria.hint.latency_sensitivity_s"
SESSION_END = "talaria.session.end"


def span_attributes(hints: Any) -> dict[str, Any]:
    """The set hints of a wire ``AgentCallHints`` as span attributes (unset hints are left out)."""
    if hints is None:
        return {}
    out: dict[str, Any] = {}
    if hints.has_priority:
        out[HINT_PRIORITY] = hints.priority
    if hints.expected_output_tokens:
        out[HINT_EXPECTED_OUTPUT_TOKENS] = hints.expected_output_tokens
    if hints.expected_tool_s:
        out[HINT_EXPECTED_TOOL_S] = hints.expected_tool_s
    if hints.cache_ttl_s:
        out[HINT_CACHE_TTL_S] = hints.cache_ttl_s
    if hints.latency_sensitivity_s:
        out[HINT_LATENCY_SENSITIVITY_S] = hints.latency_sensitivity_s
    return out
