"""The residency candidates of one cold instance (JointServe §3.1-3.2) — pure policy: no torch, no engine, no
clock reads (``now`` and every cost are passed in).

Design NOTE. The cold engine's ``ResidencyDriver`` (``cold/residency.py``) and the simulator's ``SimResidency``
(``sim/residency.py``) each describe their instance as an :class:`InstanceState` — plain numbers read from
the engine's shells, staging area and host KV tier, or from the simulated instance — and :func:`candidates`
turns that into the ``ResidencyManager``'s objects with one set of rules, so the simulator plans with the
production code:

* **protected**: one KV object for the active model's in-flight work (the running batch plus what its queued
  calls will need), kept unconditionally so a plan never takes memory its own next admissions need;
* **session prefixes** cached on the device for the active model, idle (no call of theirs runs or waits):
  recovery = ``min(restore, prefill)`` seconds per token times its tokens, by path ``restore``, when the host
  KV store holds the session and a restore rate is known, else ``prefill`` per token by ``recompute``; reuse =
  ``ReuseSignals.session_reuse`` after the prefix's last use is recorded (``touch_session``);
* **layer groups** of every other loaded model, in group order: recovery = the group's reload seconds for the
  first ``startup_groups`` groups (those on the first-token path), 0 by path ``stream`` beyond them (with
  streaming hot-swap later groups load behind the first prefill, so a cold model keeps only its startup
  prefix, JointServe §4.4); reuse = ``ReuseSignals.model_reuse`` (queued calls or a requested switch, else its
  arrival rate over the window).

The objects come in that order (protected, sessions in the given order, models' groups in the given order),
which the manager's choices and explanations follow. Mutates: only the reuse signals' session clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .residency import ResidencyObject, ReuseSignals

IN_FLIGHT = "<in-flight>"  # the session name of the protected in-flight KV object


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A session prefix cached on the device, idle. ``last_use``: when the session last used it (instance clock)."""

    session: str
    model: str
    tokens: int
    nbytes: int
    last_use: float
    host_copy: bool  # the host KV store holds a valid copy


@dataclass(frozen=True, slots=True)
class GroupState:
    """One layer group of an inactive model, by position (group ``i`` is the ``i``-th of the tuple)."""

    nbytes: int  # device bytes it takes when staged
    reload_s: float  # seconds to copy it host-to-device
    resident: bool  # staged now


@dataclass(frozen=True, slots=True)
class InactiveModel:
    """A loaded model other than the active one: its intent and its layer groups."""

    model: str
    queued: int  # its calls waiting now
    requested: bool  # a switch to it is requested
    startup_groups: int  # leading groups on its first-token path (all without streaming hot-swap)
    groups: tuple[GroupState, ...]


@dataclass(frozen=True, slots=True)
class InstanceState:
    """What the candidates are built from: one instance with ``active`` on the device."""

    active: str
    in_flight_bytes: int  # protected KV of the active model: running batch + queued calls' needs
    prefill_per_token: float  # seconds
    restore_per_token: float | None  # seconds; None (or 0): no restore rate known, recompute
    cached: tuple[CachedPrefix, ...]
    inactive: tuple[InactiveModel, ...]


def candidates(state: InstanceState, signals: ReuseSignals, now: float) -> list[ResidencyObject]:
    """The protected and candidate objects of ``state`` at ``now`` (see the module note). Mutates ``signals``'
    session clocks (each cached prefix's last use)."""
    objs = [ResidencyObject("kv", state.active, state.in_flight_bytes, 0.0, 1.0, resident=True, protected=True, session=IN_FLIGHT)]
    prefill, restore = state.prefill_per_token, state.restore_per_token
    for c in state.cached:
        signals.touch_session(c.session, c.last_use)
        if c.host_copy and restore is not None and restore > 0:
            rec, path = min(restore, prefill) * c.tokens, "restore"
        else:
            rec, path = prefill * c.tokens, "recompute"
        objs.append(ResidencyObject("kv", c.model, c.nbytes, rec, signals.session_reuse(c.session, now), resident=True,
                                    session=c.session, host_copy=c.host_copy, recovery_path=path))
    for m in state.inactive:
        reuse = signals.model_reuse(m.model, m.queued, m.requested, now)
        for j, g in enumerate(m.groups):
            rec, path = (g.reload_s, "reload") if j < m.startup_groups else (0.0, "stream")
            objs.append(ResidencyObject("weights", m.model, g.nbytes, rec, reuse, group=j, resident=g.resident, recovery_path=path))
    return objs


def startup_groups(groups: int, k_for: Callable[[int], int] | None, first_prefill_tokens: Callable[[], int],
                   usual_prompt_tokens: float | None) -> int:
    """How many leading groups of a model are on its first-token path: all ``groups`` without streaming hot-swap
    (``k_for`` None); with it, k* (``k_for(tokens)``) for the tokens its waiting calls' first forward computes
    (``first_prefill_tokens()``, asked only then), else for its usual prompt length (``usual_prompt_tokens``,
    e.g. an EWMA of its calls' prompts), else all groups for a model never seen. Pure."""
    if k_for is None:
        return groups
    tokens = first_prefill_tokens()
    if not tokens and usual_prompt_tokens is not None:
        tokens = int(usual_prompt_tokens)
    return k_for(tokens) if tokens else groups
