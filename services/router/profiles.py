"""EWMA-refreshed estimates the placement cost model reads (Talaria §3.3: "refreshes its per-model latency
profiles ... using an exponentially weighted moving average"). Pure state, injected clock, no I/O.

| class | fed by | gives |
|---|---|---|
| ``ProfileBook`` | instance snapshots (``CostProfile``) | per-instance ``policy.Profile``; its peers' measurements, then config defaults, where unmeasured |
| ``ShapeBook`` | completion hooks (usage) | per-model ``policy.CallShape``: uncached suffix, prompt and decode tokens of a typical call |
| ``DemandMeter`` | call arrivals | per-model arrival rate (EWMA of inter-arrival) -> calls expected in the control window |
| ``QueueBook`` | decisions + completion hooks (``CallAttribution.engine_queue_s``) | per-instance ratio of measured to predicted queueing (Eq. 1's queue term) |
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from services.router.policy import CallShape, Profile
from talaria.cost_curve import CostCurve
from talaria.ewma import ewma
from talaria.switch_path import SwitchPath


@dataclass(frozen=True, slots=True)
class Defaults:
    prefill_per_token: float = 2e-4
    decode_step: float = 0.02
    restore_per_token: float = 2e-5
    switch_s: float = 0.5
    open_s: float = 5.0

    @classmethod
    def from_config(cls, placement) -> Defaults:
        """Cold-start priors from a ``PlacementConfig``: field ``x`` is its ``default_x`` (``_s`` appended to
        the names that lack the unit)."""
        return cls(**{f.name: getattr(placement, f"default_{f.name}" + ("" if f.name.endswith("_s") else "_s")) for f in fields(cls)})


# Which measured switch path (CostProfile.switch_costs, reported by a cold engine) prices which activation
# of policy.activation(); the first path measured wins. A loaded model with nothing staged switches host-only;
# a staged one moves (some of) its chunks device-to-device; a model not loaded is first read into the bank.
ACTIVATION_PATHS: dict[str, tuple[SwitchPath, ...]] = {
    "switch_s": (SwitchPath.HOST_ONLY,),
    "staged_switch_s": (SwitchPath.FULL_STAGED, SwitchPath.PARTIAL),
    "open_s": (SwitchPath.OPEN,),
}


# Design note ("cold-start priors only until measured"; the brief: "costs that policies use are
# measured and learned, never left at defaults"). An instance that has not yet measured a cost borrows it from
# its *peers* -- instances of the same peer group (same pool, device and served models, so the same work on the
# same kind of hardware) that have measured it: the median of their EWMAs for a scalar, the most-sampled peer's
# curve for a learned curve. Only when no peer has measured it either does the config prior price it. Without
# this, a fresh replica priced at a pessimistic prior looked dearer than a measured twin holding a queue of
# leases, so new sessions piled onto the measured one (two identical workers: three of four new sessions went to
# the first). An instance's own measurement always wins over its peers'.


class ProfileBook:
    def __init__(self, defaults: Defaults = Defaults(), alpha: float = 0.2):
        self.defaults = defaults
        self.alpha = alpha
        self._v: dict[str, dict[str, float]] = {}
        self._curves: dict[str, tuple[CostCurve | None, CostCurve | None]] = {}  # (prefill, decode)
        self._group: dict[str, tuple] = {}  # instance -> peer group (pool, device, served models)
        # per peer group, kept sorted as members' values change (a lookup never scans the fleet, see the note):
        self._sorted: dict[tuple, dict[str, list[float]]] = {}  # metric -> the members' EWMAs, ascending
        self._ranked: dict[tuple, tuple[list, list]] = {}  # (prefill, decode) -> [(-samples, id)] of members' curves
        self._models: dict[str, set[str]] = {}  # instance -> the keys of its models' own costs (``observe_model``)

    def observe(
        self, instance_id: str, prefill_per_token: float, decode_step: float, restore_per_token: float,
        switch_costs: Mapping[SwitchPath, float], prefill_by_context=(), decode_by_batch=(), group: tuple = (),
    ) -> None:
        """Fold one snapshot's measured profile in; zero means "not measured" and is skipped. The learned
        curves (``(at, seconds, samples)`` buckets, ``talaria.cost_curve``) are the engine's own EWMAs: the
        latest snapshot's replace the previous ones. ``group``: the instance's peer group (``peer_group``);
        ``()`` = no peers. Mutates: the instance's EWMAs, curves and group, and its group's sorted views."""
        if self._group.get(instance_id) != group:
            self._unindex(instance_id)
            self._group[instance_id] = group
            self._index(instance_id)
        self._rank_curves(instance_id, (_curve(prefill_by_context, self.defaults.prefill_per_token),
                                        _curve(decode_by_batch, self.defaults.decode_step)))
        cur = self._v.setdefault(instance_id, {})
        samples = {"prefill_per_token": prefill_per_token, "decode_step": decode_step, "restore_per_token": restore_per_token}
        for name, paths in ACTIVATION_PATHS.items():
            for path in paths:
                if switch_costs.get(path, 0.0) > 0:
                    samples[name] = switch_costs[path]
                    break
        vals = self._sorted.get(group) if group else None
        for k, v in samples.items():
            if v > 0:
                old, cur[k] = cur.get(k), ewma(cur.get(k), v, self.alpha)
                if vals is not None:
                    _move(vals.setdefault(k, []), old, cur[k])

    def forget(self, instance_id: str) -> None:
        """Drop what the instance measured, its models' costs included. Mutates the book."""
        for key in [instance_id, *self._models.pop(instance_id, ())]:
            self._unindex(key)
            self._v.pop(key, None)
            self._curves.pop(key, None)
            self._group.pop(key, None)

    # Per-model costs: a cold instance serves models of different sizes and its instance profile is
    # the active model's. Each model's own costs (``ModelState.cost``) are kept under a key of their own whose
    # peer group is the instance's plus the model, so an instance that has not run a model yet borrows that
    # model's costs from its peers, never another model's.
    def observe_model(
        self, instance_id: str, model: str, prefill_per_token: float, decode_step: float, restore_per_token: float,
        prefill_by_context=(), decode_by_batch=(), group: tuple = (),
    ) -> None:
        """Fold one snapshot's costs of ``model`` on the instance in (``observe`` without switch costs).
        Mutates: that model's EWMAs, curves and peer views."""
        key = _model_key(instance_id, model)
        self._models.setdefault(instance_id, set()).add(key)
        self.observe(key, prefill_per_token, decode_step, restore_per_token, {}, prefill_by_context, decode_by_batch,
                     group + (model,) if group else ())

    def model_profile(self, instance_id: str, model: str, base: Profile) -> Profile | None:
        """The costs of ``model`` on the instance: its own measurements, else its peers' for the same model;
        what neither measured, ``base``'s (the instance profile); switch costs always ``base``'s. None when
        nothing about the model is measured here or at a peer (``base`` prices it). Pure read."""
        group = self._group.get(instance_id, ())
        group = group + (model,) if group else ()  # the model's peers, whether or not this instance measured it
        cost, prefill_curve, decode_curve = self._lookup(_model_key(instance_id, model), group)
        scalars = {n: cost(n, None) for n in ("prefill_per_token", "decode_step", "restore_per_token")}
        if prefill_curve is None and decode_curve is None and all(v is None for v in scalars.values()):
            return None
        return replace(base, **{n: v for n, v in scalars.items() if v is not None},
                       prefill_by_context=prefill_curve or base.prefill_by_context, decode_by_batch=decode_curve or base.decode_by_batch)

    def _index(self, instance_id: str) -> None:
        """Add the instance's values and curves to its group's sorted views. Mutates them."""
        group = self._group.get(instance_id, ())
        if not group:
            return
        vals = self._sorted.setdefault(group, {})
        for k, v in self._v.get(instance_id, {}).items():
            insort(vals.setdefault(k, []), v)
        ranked = self._ranked.setdefault(group, ([], []))
        for which, c in enumerate(self._curves.get(instance_id, (None, None))):
            if c is not None:
                insort(ranked[which], (-_samples(c), instance_id))

    def _unindex(self, instance_id: str) -> None:
        """Take the instance's values and curves out of its group's sorted views. Mutates them."""
        group = self._group.get(instance_id, ())
        if not group or group not in self._sorted:
            return
        vals = self._sorted[group]
        for k, v in self._v.get(instance_id, {}).items():
            _move(vals.get(k, []), v, None)
        for which, c in enumerate(self._curves.get(instance_id, (None, None))):
            if c is not None:
                _move(self._ranked[group][which], (-_samples(c), instance_id), None)

    def _rank_curves(self, instance_id: str, curves: tuple) -> None:
        """Replace the instance's curves, keeping its group's ranking of curves by samples. Mutates both."""
        group = self._group.get(instance_id, ())
        old = self._curves.get(instance_id, (None, None))
        self._curves[instance_id] = curves
        if not group:
            return
        ranked = self._ranked.setdefault(group, ([], []))
        for which in (0, 1):
            a, b = old[which], curves[which]
            _move(ranked[which], None if a is None else (-_samples(a), instance_id), None if b is None else (-_samples(b), instance_id))

    def profile(self, instance_id: str) -> Profile:
        """The instance's measured costs; what it has not measured, its peers' (design note above); else the
        config priors. Pure read. The peers are looked up only for what the instance has not measured (a
        measured instance costs O(1), whatever the fleet's size)."""
        d = self.defaults
        cost, prefill_curve, decode_curve = self._lookup(instance_id, self._group.get(instance_id, ()))
        switch = cost("switch_s", d.switch_s)
        return Profile(
            prefill_per_token=cost("prefill_per_token", d.prefill_per_token),
            decode_step=cost("decode_step", d.decode_step),
            restore_per_token=cost("restore_per_token", d.restore_per_token),
            switch_s=switch,
            staged_switch_s=cost("staged_switch_s", switch),
            open_s=cost("open_s", d.open_s),
            prefill_by_context=prefill_curve,
            decode_by_batch=decode_curve,
        )

    def _lookup(self, key: str, group: tuple):
        """What ``key`` (an instance, or one model on it) is priced with: ``cost(name, fallback)`` -- its own
        EWMA, else the median of its peers' (``group``), else ``fallback`` -- and its prefill and decode curves,
        its own else the most-sampled peer's (None: neither measured). Pure read."""
        v = self._v.get(key, {})
        vals = self._sorted.get(group, {}) if group else {}

        def cost(name: str, fallback):
            if name in v:
                return v[name]
            seen = vals.get(name)  # the peers' values only: ``key`` has not measured ``name``
            return seen[len(seen) // 2] if seen else fallback

        prefill_curve, decode_curve = self._curves.get(key, (None, None))
        return cost, prefill_curve or self._peer_curve(key, group, 0), decode_curve or self._peer_curve(key, group, 1)

    def _peer_curve(self, instance_id: str, group: tuple, which: int) -> CostCurve | None:
        """The most-sampled measured curve of the instance's peers (``which``: 0 prefill, 1 decode; ties: the
        smallest id), or None."""
        for neg, j in self._ranked.get(group, ([], []))[which] if group else ():
            if neg < 0 and j != instance_id:
                return self._curves[j][which]
            if neg >= 0:
                break
        return None


def _model_key(instance_id: str, model: str) -> str:
    return f"{instance_id}\x1f{model}"


def _samples(c: CostCurve) -> int:
    return sum(p[2] for p in c.points())


def _move(lst: list, old, new) -> None:
    """In the sorted ``lst``, replace one ``old`` (None: nothing to take out) by ``new`` (None: nothing to put
    in). O(len) memmove, no Python loop. Mutates ``lst``."""
    if old is not None:
        i = bisect_left(lst, old)
        if i < len(lst) and lst[i] == old:
            del lst[i]
    if new is not None:
        insort(lst, new)


def peer_group(snap) -> tuple:
    """The peer group of an ``InstanceSnapshot``: instances that do the same work on the same kind of hardware
    (pool, device, served models) and so may lend each other their measured costs."""
    return (int(snap.pool), snap.device, tuple(sorted(m.model for m in snap.models)))


def _curve(points, prior: float) -> CostCurve | None:
    """A curve of a heartbeat's buckets; None when the engine has measured none (the scalars price)."""
    if not points:
        return None
    c = CostCurve(prior)
    c.load(points)
    return c if c.measured else None


class ShapeBook:
    def __init__(self, alpha: float = 0.2, default: CallShape = CallShape()):
        self.alpha = alpha
        self.default = default
        self._v: dict[str, CallShape] = {}

    def observe(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        cur = self._v.get(model)
        a = self.alpha
        suffix = max(0, prompt_tokens - cached_tokens)
        if cur is None:
            self._v[model] = CallShape(float(suffix), float(prompt_tokens), float(completion_tokens))
        else:
            self._v[model] = CallShape(
                ewma(cur.suffix_tokens, suffix, a), ewma(cur.prompt_tokens, prompt_tokens, a), ewma(cur.decode_tokens, completion_tokens, a)
            )

    def shape(self, model: str) -> CallShape:
        return self._v.get(model, self.default)


class DemandMeter:
    """Per-model arrival rate from an EWMA of inter-arrival times (clock-injected through ``now``)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self._last: dict[str, float] = {}
        self._gap: dict[str, float] = {}

    def arrival(self, model: str, now: float) -> None:
        last = self._last.get(model)
        self._last[model] = now
        if last is not None:
            self._gap[model] = ewma(self._gap.get(model), max(1e-3, now - last), self.alpha)

    def models(self) -> list[str]:
        """Models that have had arrivals."""
        return list(self._gap)

    def rate(self, model: str, now: float) -> float:
        """Calls per second; decays when arrivals stop (the open gap counts once it exceeds the mean)."""
        gap = self._gap.get(model)
        last = self._last.get(model)
        if gap is None or last is None:
            return 0.0
        return 1.0 / max(gap, now - last)


class QueueBook:
    """How far Eq. 1's queue term is from the queueing the engines measure (costs learned from
    reality). Pure state: no clock, no I/O; mutated only by ``observe`` / ``forget``.

    Design note. ``policy.queue_pressure`` counts the calls ahead of a new one in mean calls: waiting and
    forwarded calls at 1, a live lease at ``admission_unit`` (1), a running call at ``running_weight``
    (0.5) -- configured weights, not measurements. On a continuously batching engine a running call delays
    a new one mostly through shared steps (Eq. 1 prices that separately), and a lease's return may never
    come; on the bench (session 32, 5 repetitions per workload) the chosen instance's predicted queue
    averaged 0.20-0.26 s a call against 0.02-0.04 s of measured engine queue, so the queue term outweighed
    the switch, restore and prefill terms the decision is for. The book keeps, per instance, an EWMA of the
    queue Eq. 1 predicted for each call placed there (before any scaling) and of the engine's measured
    queue for the same call (received -> admitted; a cold engine's wait for its model's slot is
    ``round_wait_s``, priced by the activation term, not here); ``scale`` is their ratio, which the router
    multiplies the pressure by. Only chosen instances are observed; an instance with fewer than
    ``min_samples`` uses the median scale of those with enough, else 1 (the configured weights as they are).
    Bounded to ``[lo, hi]`` so one outlier cannot switch the term off or blow it up.
    """

    def __init__(self, alpha: float = 0.1, min_samples: int = 8, lo: float = 0.02, hi: float = 4.0):
        if not 0 < alpha <= 1 or min_samples < 1 or not 0 < lo <= 1 <= hi:
            raise ValueError("QueueBook: alpha in (0, 1], min_samples >= 1, lo <= 1 <= hi")
        self.alpha, self.min_samples, self.lo, self.hi = alpha, min_samples, lo, hi
        self._v: dict[str, tuple[float, float, int]] = {}  # instance -> (predicted EWMA, measured EWMA, samples)
        self._known: list[float] = []  # the measured instances' own scales, kept sorted (``scale`` never scans the fleet)

    def observe(self, instance_id: str, predicted_s: float, measured_s: float) -> None:
        """One placed call: the queue Eq. 1 predicted on ``instance_id`` (unscaled) and the engine's measured
        queue. Mutates: that instance's EWMAs."""
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)) or predicted_s < 0 or measured_s < 0:
            return
        old = self._own(instance_id)
        p, m, n = self._v.get(instance_id, (None, None, 0))
        self._v[instance_id] = (ewma(p, predicted_s, self.alpha), ewma(m, measured_s, self.alpha), n + 1)
        _move(self._known, old, self._own(instance_id))

    def forget(self, instance_id: str) -> None:
        """Drop an instance that left (a new epoch starts unmeasured). Mutates: the book."""
        _move(self._known, self._own(instance_id), None)
        self._v.pop(instance_id, None)

    def _own(self, instance_id: str) -> float | None:
        v = self._v.get(instance_id)
        if v is None or v[2] < self.min_samples or v[0] <= 1e-9:
            return None  # unmeasured, or Eq. 1 predicted no queue at all there (nothing to scale)
        return min(self.hi, max(self.lo, v[1] / v[0]))

    def scale(self, instance_id: str) -> float:
        """The factor Eq. 1's queue pressure on ``instance_id`` is multiplied by: its own measured ratio, else
        the median of the measured instances', else 1. Pure read."""
        own = self._own(instance_id)
        if own is not None:
            return own
        known = self._known
        return known[len(known) // 2] if known else 1.0

    def stats(self) -> dict[str, dict[str, float]]:
        """Per instance: the EWMAs, samples and the scale in use (``/router/metrics``)."""
        return {i: {"predicted_s": p, "measured_s": m, "samples": n, "scale": self.scale(i)} for i, (p, m, n) in self._v.items()}
