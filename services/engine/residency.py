"""One residency budget for weights and KV (JointServe §3) —
pure policy: no torch, no I/O, no clock reads (``now`` is passed in).

Design NOTE.
* Candidates (§3.1) are *model layer groups* and *session KV prefixes*, each keeping its model or session
  identity. Candidate ``i`` has a size ``s_i`` (device bytes), an expected reuse count ``p_i`` in the
  look-ahead window and a cheapest-path recovery cost ``c_i`` (§3.2): a layer group reloads from the host
  weight bank (its bytes at the measured host→device rate); a KV prefix restores from the host KV store when a
  valid copy exists (measured restore seconds per token + round trip), else it is recomputed (measured prefill
  seconds per token). Its retention value is ``u_i = p_i·c_i`` (expected recovery work avoided), its
  density ``u_i/s_i``.
* Protected objects (the active model's groups, in-flight sessions' KV, an arriving model's committed
  startup prefix) are kept unconditionally; ``B_f = B − P`` is left for selection. If the protected set
  alone exceeds ``B`` the plan reports the shortfall and keeps only the protected set (§3.1, "the execution
  layer handles the shortfall").
* Legality (§3.1 "dependencies require complete legal options per model"): a model's groups are useful only
  as a *prefix* (streaming loads groups in order, JointServe §4.4), so each model is one class whose options
  are its prefixes ``k = 0..G``; each session prefix is a class with options {drop, keep}. Selection is a
  multiple-choice knapsack solved by a value-scaling dynamic program (§3.4): values are rounded to units of
  ``ε·L/n`` (``L`` = best of the density-greedy fill and the best single option, ``n`` = classes) and for each
  rounded value the smallest-size plan is kept, so the result is within ``(1 − ε)`` of the best estimated
  value while sizes stay exact (the budget is never exceeded); capacity the rounding left unused is then
  filled by extending options, best value per byte first (§3.4 "filling later fitting objects may add value").
* The plan (§4.2) is a differential: the target set, and actions relative to current residency — ``load``
  (a group not on the device), ``restore`` (a prefix with a host copy), ``release`` (resident, not kept, a
  host copy exists) or ``offload`` (resident KV without a host copy: write back before release). Plans are
  versioned; the version moves only when the target changes. Every candidate's choice is explained as data
  (:class:`Choice`: size, reuse, recovery, value, density, selected, why).
* Reuse estimates (§4.1, signals by quality): :class:`ReuseSignals` gives an explicit intent (a requested
  model, queued calls) a reuse of at least one per queued call, a model seen recently its arrival rate times
  the window, and a session its return probability from the time since its last call and its mean tool gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from talaria.ewma import ewma

Kind = Literal["weights", "kv"]


@dataclass(frozen=True, slots=True)
class ResidencyObject:
    """One candidate. ``key`` is ``("weights", model, group)`` or ``("kv", model, session)``."""

    kind: Kind
    model: str
    nbytes: int
    recovery_s: float  # cheapest-path recovery seconds if evicted (reload / restore / recompute)
    reuse: float  # expected reuses within the look-ahead window (>= 0)
    resident: bool = False
    protected: bool = False
    group: int = 0  # weights: layer-group index (groups are kept as a prefix)
    session: str = ""  # kv: session id
    host_copy: bool = True  # weights: always (the bank); kv: a valid copy in the host KV store
    recovery_path: str = "reload"  # reload | restore | recompute

    @property
    def key(self) -> tuple[str, str, int | str]:
        return ("weights", self.model, self.group) if self.kind == "weights" else ("kv", self.model, self.session)

    @property
    def value(self) -> float:
        return max(self.reuse, 0.0) * max(self.recovery_s, 0.0)


@dataclass(frozen=True, slots=True)
class Choice:
    """Why a candidate is (not) in the target: the knapsack's choice as data."""

    key: tuple
    nbytes: int
    reuse: float
    recovery_s: float
    recovery_path: str
    value_s: float
    density: float  # value seconds per MiB
    selected: bool
    why: str  # protected | selected | too_big | no_value | outvalued | prefix_dependency | shortfall


@dataclass(frozen=True, slots=True)
class Action:
    op: str  # load | restore | release | offload
    key: tuple
    nbytes: int


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    version: int
    budget_bytes: int
    protected_bytes: int
    target_bytes: int  # protected + selected; <= budget unless shortfall_bytes > 0
    value_s: float  # estimated recovery work the selected (unprotected) objects avoid
    lower_bound_s: float  # L of the value scaling (greedy / best single)
    epsilon: float
    shortfall_bytes: int  # protected bytes beyond the budget (then nothing else is kept)
    target: frozenset
    actions: tuple[Action, ...]
    choices: tuple[Choice, ...]

    def kept(self, kind: Kind, model: str | None = None) -> list[tuple]:
        return sorted((k for k in self.target if k[0] == kind and (model is None or k[1] == model)), key=str)

    def weight_prefix(self, model: str) -> int:
        """How many leading layer groups of ``model`` the target keeps."""
        gs = {k[2] for k in self.target if k[0] == "weights" and k[1] == model}
        n = 0
        while n in gs:
            n += 1
        return n

    def to_dict(self) -> dict:
        return {
            "version": self.version, "budget_bytes": self.budget_bytes, "protected_bytes": self.protected_bytes,
            "target_bytes": self.target_bytes, "value_s": self.value_s, "shortfall_bytes": self.shortfall_bytes,
            "actions": [(a.op, list(a.key), a.nbytes) for a in self.actions],
            "choices": [dict(key=list(c.key), nbytes=c.nbytes, value_s=c.value_s, density=c.density, selected=c.selected, why=c.why) for c in self.choices],
        }


# ---------------------------------------------------------------------- the selection (pure functions)
@dataclass(frozen=True, slots=True)
class _Option:
    size: int
    value: float
    keys: tuple


def _classes(cands: list[ResidencyObject]) -> list[list[_Option]]:
    """Legal options per class: prefixes of each model's unprotected groups; keep/drop per KV prefix."""
    by_model: dict[str, list[ResidencyObject]] = {}
    out: list[list[_Option]] = []
    for o in cands:
        if o.kind == "weights":
            by_model.setdefault(o.model, []).append(o)
        else:
            out.append([_Option(0, 0.0, ()), _Option(o.nbytes, o.value, (o.key,))])
    for groups in by_model.values():
        groups.sort(key=lambda g: g.group)
        opts = [_Option(0, 0.0, ())]
        size, value, keys = 0, 0.0, ()
        for g in groups:
            size, value, keys = size + g.nbytes, value + g.value, keys + (g.key,)
            opts.append(_Option(size, value, keys))
        out.append(opts)
    return out


def _lower_bound(classes: list[list[_Option]], cap: int) -> float:
    """L = max(density-greedy over whole options, at most one per class, best single fitting option): the
    value of a feasible legal set, so a true lower bound of the optimum."""
    best_single = max((o.value for c in classes for o in c if o.size <= cap), default=0.0)
    opts = sorted(((o.value / max(o.size, 1), i, o) for i, c in enumerate(classes) for o in c[1:]), key=lambda t: (-t[0], t[1]))
    used, g, taken = 0, 0.0, set()
    for _, i, o in opts:
        if i not in taken and used + o.size <= cap:
            used, g = used + o.size, g + o.value
            taken.add(i)
    return max(best_single, g)


def _fill(classes: list[list[_Option]], chosen: list[int], cap: int) -> list[int]:
    """Use residual capacity the rounding left: extend a class's option to a larger legal one that still fits,
    best value gained per extra byte first (never lowers the value)."""
    used = sum(classes[i][k].size for i, k in enumerate(chosen))
    while True:
        best = None
        for i, k in enumerate(chosen):
            for k2 in range(k + 1, len(classes[i])):
                extra = classes[i][k2].size - classes[i][k].size
                gain = classes[i][k2].value - classes[i][k].value
                if gain > 0 and used + extra <= cap and (best is None or gain / max(extra, 1) > best[0]):
                    best = (gain / max(extra, 1), i, k2, extra)
        if best is None:
            return chosen
        _, i, k2, extra = best
        chosen[i], used = k2, used + extra


def select(cands: list[ResidencyObject], capacity: int, epsilon: float = 0.05, max_states: int = 20000) -> tuple[frozenset, float, float]:
    """The (1−ε)-best legal set of ``cands`` within ``capacity`` bytes: (keys, value, L). Sizes are exact."""
    # a zero-value group still belongs to its model's prefixes (a later group may need it); KV without value
    # never helps
    classes = [c for c in _classes([o for o in cands if o.kind == "weights" or o.value > 0]) if max(o.value for o in c) > 0]
    if capacity <= 0 or not classes:
        return frozenset(), 0.0, 0.0
    lower = _lower_bound(classes, capacity)
    if lower <= 0:
        return frozenset(), 0.0, 0.0
    total = sum(max(o.value for o in c) for c in classes)
    unit = max(epsilon * lower / len(classes), total / max_states)
    # rounded value -> (size, value, choice per class): the smallest-size plan reaching that rounded value
    states: dict[int, tuple[int, float, tuple[int, ...]]] = {0: (0, 0.0, ())}
    for opts in classes:
        nxt: dict[int, tuple[int, float, tuple[int, ...]]] = {}
        for rv, (sz, val, ch) in states.items():
            for k, o in enumerate(opts):
                s2 = sz + o.size
                if s2 > capacity:
                    break  # options are prefixes/keeps of growing size
                r2 = rv + int(o.value / unit)
                cur = nxt.get(r2)
                if cur is None or s2 < cur[0] or (s2 == cur[0] and val + o.value > cur[1]):
                    nxt[r2] = (s2, val + o.value, ch + (k,))
        states = nxt
    _, _, ch = max(states.values(), key=lambda t: (t[1], -t[0]))
    chosen = _fill(classes, list(ch), capacity)
    keys = tuple(key for i, k in enumerate(chosen) for key in classes[i][k].keys)
    return frozenset(keys), sum(classes[i][k].value for i, k in enumerate(chosen)), lower


# ---------------------------------------------------------------------- the manager
class ResidencyManager:
    """Versioned residency plans under one device budget (JointServe §3.3-3.4, §4.2). Mutates only its own
    version counter and last target."""

    def __init__(self, epsilon: float = 0.05) -> None:
        if not 0 < epsilon < 1:
            raise ValueError("epsilon must be in (0, 1)")
        self.epsilon = epsilon
        self.version = 0
        self._last_target: frozenset | None = None
        self.last: ResidencyPlan | None = None

    def plan(self, objects: list[ResidencyObject], budget_bytes: int) -> ResidencyPlan:
        """Choose the target set for ``objects`` under ``budget_bytes`` and diff it against residency."""
        seen: set = set()
        for o in objects:
            if o.key in seen:
                raise ValueError(f"duplicate residency object {o.key}")
            seen.add(o.key)
            if o.nbytes < 0 or not math.isfinite(o.recovery_s) or not math.isfinite(o.reuse):
                raise ValueError(f"residency object {o.key} has a negative size or a non-finite cost")
        prot = [o for o in objects if o.protected]
        p_bytes = sum(o.nbytes for o in prot)
        free = budget_bytes - p_bytes
        cands = [o for o in objects if not o.protected]
        keys, value, lower = select(cands, free, self.epsilon) if free > 0 else (frozenset(), 0.0, 0.0)
        target = frozenset(o.key for o in prot) | keys
        if target != self._last_target:
            self.version += 1
            self._last_target = target
        size = sum(o.nbytes for o in objects if o.key in target)
        plan = ResidencyPlan(
            self.version, budget_bytes, p_bytes, size, value, lower, self.epsilon, max(0, -free), target,
            _actions(objects, target), _explain(objects, target, free),
        )
        self.last = plan
        return plan


def _actions(objects: list[ResidencyObject], target: frozenset) -> tuple[Action, ...]:
    out = []
    for o in objects:
        keep = o.key in target
        if keep and not o.resident:
            out.append(Action("load" if o.kind == "weights" else "restore", o.key, o.nbytes))
        elif not keep and o.resident:
            out.append(Action("release" if o.host_copy else "offload", o.key, o.nbytes))
    # offloads (write-back) first: their source buffer stays occupied until the copy finished (§4.2)
    order = {"offload": 0, "release": 1, "restore": 2, "load": 3}
    return tuple(sorted(out, key=lambda a: (order[a.op], str(a.key))))


def _explain(objects: list[ResidencyObject], target: frozenset, free: int) -> tuple[Choice, ...]:
    out = []
    kept_groups: dict[str, set[int]] = {}
    for k in target:
        if k[0] == "weights":
            kept_groups.setdefault(k[1], set()).add(k[2])
    for o in objects:
        sel = o.key in target
        if o.protected:
            why = "protected"
        elif sel:
            why = "selected"
        elif free <= 0:
            why = "shortfall"
        elif o.value <= 0:
            why = "no_value"
        elif o.nbytes > free:
            why = "too_big"
        elif o.kind == "weights" and o.group > 0 and (o.group - 1) not in kept_groups.get(o.model, set()) and any(
                p.kind == "weights" and p.model == o.model and p.group == o.group - 1 and not p.protected for p in objects):
            why = "prefix_dependency"  # its predecessor group is not kept, so keeping it would not help
        else:
            why = "outvalued"
        out.append(Choice(o.key, o.nbytes, o.reuse, o.recovery_s, o.recovery_path, o.value,
                          o.value / max(o.nbytes / (1 << 20), 1e-12), sel, why))
    return tuple(out)


# ---------------------------------------------------------------------- reuse signals (§4.1)
@dataclass(slots=True)
class ReuseSignals:
    """Expected reuses within a window from the instance's own signals (pure; ``now`` passed in).

    Models: an explicit intent (requested, or calls queued) counts as certain (one reuse per queued call, at
    least one); otherwise the model's EWMA arrival rate (one call per window after a single call) times the
    window, decayed by the time since its last call. Sessions: ``exp(-age/gap)`` with the
    session's mean tool gap (a session that returns quickly and recently is likely to return). Mutates: itself."""

    window_s: float = 10.0
    alpha: float = 0.3
    _model_rate: dict[str, float] = field(default_factory=dict)
    _model_last: dict[str, float] = field(default_factory=dict)
    _sess_gap: dict[str, float] = field(default_factory=dict)
    _sess_last: dict[str, float] = field(default_factory=dict)

    def observe_call(self, model: str, session: str, now: float) -> None:
        last = self._model_last.get(model)
        if last is not None and now > last:
            self._model_rate[model] = ewma(self._model_rate.get(model), 1.0 / (now - last), self.alpha)
        self._model_last[model] = now
        if session:
            sl = self._sess_last.get(session)
            if sl is not None and now > sl:
                self._sess_gap[session] = ewma(self._sess_gap.get(session), now - sl, self.alpha)
            self._sess_last[session] = now

    def session_ended(self, session: str, now: float) -> None:
        self._sess_last[session] = now

    def touch_session(self, session: str, last_use: float) -> None:
        """The session was last used at ``last_use`` (e.g. its device cache entry's time); keeps the latest."""
        if last_use > self._sess_last.get(session, float("-inf")):
            self._sess_last[session] = last_use

    def model_reuse(self, model: str, queued: int, requested: bool, now: float) -> float:
        if queued or requested:
            return float(max(queued, 1))
        last = self._model_last.get(model)
        if last is None:
            return 0.0
        rate = self._model_rate.get(model, 1.0 / self.window_s)  # seen once: prior of one call per window
        return min(rate * self.window_s, 10.0) * math.exp(-max(0.0, now - last) / self.window_s)

    def session_reuse(self, session: str, now: float) -> float:
        last = self._sess_last.get(session)
        if last is None:
            return 0.0
        gap = self._sess_gap.get(session, self.window_s / 2)
        return math.exp(-max(0.0, now - last) / max(gap, 1e-3))
