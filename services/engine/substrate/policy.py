"""Switch and staging *policy*: pure functions of a view of the engine, with the clock passed in.

Nothing here touches torch, memory or threads, so the same code runs in the engine, in unit tests and in a
simulator. :class:`IdleSwitchRule` drives a plain ``ColdEngine`` (``slot_scheduler: false``); the default
cold engine's switch policy is ``cold.slotted.SlotSwitching``, whose round scheduler is in ``slots/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from talaria.switch_path import SwitchPath


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the policies see: the active model, whether it has work, and the queues of the others."""

    active: str | None
    active_busy: bool  # the active model has running or queued calls
    queued: dict[str, int] = field(default_factory=dict)  # model -> calls waiting (not active model)
    oldest_arrival: dict[str, float] = field(default_factory=dict)  # model -> arrival of its oldest call
    requested: str | None = None  # a model asked for by control (OPEN)
    previous: str | None = None  # the model active before the current one
    loaded: tuple[str, ...] = ()


class IdleSwitchRule:
    """Switch when the active model has no work and another model has queued calls (oldest call first);
    a model requested by control is preferred. Never switches away from a busy model."""

    def decide(self, view: EngineView, now: float) -> str | None:
        if view.active_busy:
            return None
        if view.requested and view.requested != view.active and view.requested in view.loaded:
            return view.requested
        waiting = [m for m, n in view.queued.items() if n > 0 and m != view.active and m in view.loaded]
        if not waiting:
            return None
        return min(waiting, key=lambda m: (view.oldest_arrival.get(m, now), m))


def predict_next(view: EngineView, now: float) -> str | None:
    """The model to stage: a requested one, else the one with the oldest queued call, else the previously
    active one (A→B→A), else none."""
    if view.requested and view.requested != view.active and view.requested in view.loaded:
        return view.requested
    waiting = [m for m, n in view.queued.items() if n > 0 and m != view.active and m in view.loaded]
    if waiting:
        return min(waiting, key=lambda m: (view.oldest_arrival.get(m, now), m))
    if view.previous and view.previous != view.active and view.previous in view.loaded:
        return view.previous
    return None


def plan_staging(num_chunks: int, staged: set[int], free_slots: int, budget: int) -> list[int]:
    """Chunk indices to start staging now: the lowest not yet staged, at most ``min(free_slots, budget)``."""
    n = min(free_slots, budget)
    out: list[int] = []
    for j in range(num_chunks):
        if len(out) >= n:
            break
        if j not in staged:
            out.append(j)
    return out


def classify_path(num_chunks: int, d2d_chunks: int) -> SwitchPath:
    if num_chunks and d2d_chunks == num_chunks:
        return SwitchPath.FULL_STAGED
    if d2d_chunks == 0:
        return SwitchPath.HOST_ONLY
    return SwitchPath.PARTIAL


