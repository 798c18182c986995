"""Placement for the foundation router: any healthy instance serving the model, the session's previous
instance preferred, otherwise the least loaded (ties broken by instance id, so decisions are
deterministic). Pure: it reads views and returns a decision with its reasons as data.

The cost-based placement with soft reservations of Talaria §3.3 / Algorithm 1 replaces this policy
(issue 6); the decision type stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.registry import InstanceView


@dataclass(frozen=True, slots=True)
class Decision:
    instance_id: str | None
    reason: str  # "session-affinity" | "least-loaded" | "no-candidate"
    loads: dict[str, int] = field(default_factory=dict)  # candidate -> load seen at decision time


def place(candidates: list[InstanceView], previous_instance: str | None) -> Decision:
    """Choose an instance among healthy ``candidates`` (all serve the model). Mutates nothing."""
    loads = {c.instance_id: c.load for c in candidates}
    if not candidates:
        return Decision(None, "no-candidate", loads)
    if previous_instance is not None and previous_instance in loads:
        return Decision(previous_instance, "session-affinity", loads)
    best = min(candidates, key=lambda c: (c.load, c.instance_id))
    return Decision(best.instance_id, "least-loaded", loads)
