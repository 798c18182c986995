"""Unified residency on a simulated cold instance: the mechanism side of ``services/engine/cold/residency.py``.

Design NOTE (JointServe §3-§4.2). The policy is
the engine's own ``services.engine.residency.ResidencyManager`` (a multiple-choice knapsack over model layer
groups and session KV prefixes under one device budget, valued by the recovery work each avoids) fed by the
engine's ``ReuseSignals``, and the candidates come from the engine's own
``services.engine.residency_candidates.candidates`` — the function the engine's ``ResidencyDriver`` calls. This
module only describes the simulated instance as that function's ``InstanceState`` and carries the plan out:

* **budget**: the active model's KV region (the arena minus its weights), where the engine stages weights too.
* **protected**: the KV of the running batch and what the active model's queued calls will need (prompt +
  output tokens), so a plan never takes memory its own next admissions need.
* **session prefixes** of the active model cached on the device: recovery = the learned restore seconds per
  token (when the host KV store holds the session) or prefill seconds per token, times its tokens; reuse =
  ``ReuseSignals.session_reuse`` (its return probability from its last use and mean tool gap).
* **layer groups** of every other loaded model (``layer_groups`` equal groups): recovery = one group's share of
  the switch's H2D copy; with streaming hot-swap (``partial_layers``) only the startup prefix k* has a recovery cost
  (later groups stream behind the first prefill), so a cold model keeps only that prefix; reuse =
  ``ReuseSignals.model_reuse`` (queued calls, else its arrival rate over the window).

Carrying out: sessions outside the target leave the device (their host copy, if any, stays); each model's
staged bytes are trimmed to its planned prefix at once and grow toward it at the H2D rate, models in order of
reuse (one channel); staging yields to KV (the total staged never exceeds the region's free bytes, trimmed
from the least reused first). Replanning every ``every`` decisions, as the engine replans every few steps.
Mutates: only the instance it is given (device sessions) and itself (staged bytes, plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.engine.residency import ResidencyManager, ResidencyObject, ResidencyPlan, ReuseSignals
from services.engine.residency_candidates import CachedPrefix, GroupState, InactiveModel, InstanceState, candidates, startup_groups
from talaria.ewma import Ewma

if TYPE_CHECKING:
    from .instance import SimInstance


class SimResidency:
    def __init__(self, window_s: float = 10.0, every: int = 4) -> None:
        self.manager = ResidencyManager()
        self.signals = ReuseSignals(window_s=window_s)
        self.every = max(1, every)
        self.plan: ResidencyPlan | None = None
        self.staged: dict[str, float] = {}  # model -> staged bytes (a prefix of its groups)
        self.targets: list[tuple[str, float]] = []  # (model, planned prefix bytes), most reused first
        self.released_sessions = 0
        self.plans = 0
        self._t = 0.0
        self._calls = 0
        self.prompt_tokens: dict[str, Ewma] = {}  # per model: its calls' prompt length (k* when nothing waits)

    # ------------------------------------------------------------------ signals
    def observe_call(self, model: str, session: str, prompt_tokens: int, now: float) -> None:
        """A call reached the instance (mutates the reuse signals and the model's prompt-length history)."""
        self.signals.observe_call(model, session, now)
        self.prompt_tokens.setdefault(model, Ewma(float(prompt_tokens))).add(float(prompt_tokens))

    # ------------------------------------------------------------------ staged weights
    def advance(self, inst: SimInstance, now: float) -> None:
        """Staging progress up to ``now`` at the H2D rate, targets in order; capped by the region's free
        bytes (KV first). Mutates ``staged``."""
        dt, self._t = max(0.0, now - self._t), now
        for m, want in self.targets:
            have = self.staged.get(m, 0.0)
            if dt <= 0 or have >= want:
                continue
            rate = inst.profile.h2d_bytes_per_s(m)
            take = min(want - have, dt * rate)
            self.staged[m] = have + take
            dt -= take / rate
        over = sum(self.staged.values()) - inst.kv_free_bytes()
        for m, _ in reversed(self.targets):  # staging yields to KV, least reused first
            if over <= 0:
                break
            cut = min(over, self.staged.get(m, 0.0))
            self.staged[m] = self.staged.get(m, 0.0) - cut
            over -= cut

    def fraction(self, inst: SimInstance, model: str, now: float) -> float:
        """The staged share of ``model``'s weights at ``now`` (mutates staging progress)."""
        self.advance(inst, now)
        return max(0.0, min(1.0, self.staged.get(model, 0.0) / max(1, inst.profile.model(model).weight_bytes)))

    def activated(self, model: str) -> None:
        """``model`` became active: its staged bytes moved into place (mutates ``staged``, ``targets``)."""
        self.staged.pop(model, None)
        self.targets = [(m, b) for m, b in self.targets if m != model]

    # ------------------------------------------------------------------ the plan
    def step(self, inst: SimInstance, now: float) -> None:
        """Every ``every`` decisions: replan and carry the plan out. Mutates the instance's device sessions and
        this object's plan, targets and staged bytes."""
        self.advance(inst, now)
        self._calls += 1
        if self.plan is not None and self._calls % self.every:
            return
        objs, budget = self.objects(inst, now)
        if budget <= 0:
            return
        self.plan = self.manager.plan(objs, budget)
        self.plans += 1
        for act in self.plan.actions:
            if act.key[0] == "kv" and act.op in ("release", "offload") and act.key[1] == inst.active:
                if inst.device.pop(str(act.key[2]), None) is not None:
                    self.released_sessions += 1
        targets = []
        for m in inst.loaded:
            if m == inst.active:
                continue
            want = self.plan.weight_prefix(m) / inst.groups * inst.profile.model(m).weight_bytes
            self.staged[m] = min(self.staged.get(m, 0.0), want)  # release what the plan no longer keeps
            if want > 0:
                targets.append((m, want, self._reuse(m)))
        for m in [m for m in self.staged if m not in inst.loaded or m == inst.active]:
            del self.staged[m]
        self.targets = [(m, b) for m, b, _ in sorted(targets, key=lambda t: -t[2])]

    def _reuse(self, model: str) -> float:
        assert self.plan is not None
        return max((c.reuse for c in self.plan.choices if c.key[0] == "weights" and c.key[1] == model), default=0.0)

    def objects(self, inst: SimInstance, now: float) -> tuple[list[ResidencyObject], int]:
        """The candidates and protected objects of ``inst`` (the engine's ``residency_candidates.candidates`` on
        :meth:`state`, as ``ResidencyDriver.objects``) and the budget in bytes. Mutates only the reuse signals'
        session clocks."""
        st = self.state(inst, now)
        if st is None:
            return [], 0
        state, budget = st
        return candidates(state, self.signals, now), budget

    def state(self, inst: SimInstance, now: float) -> tuple[InstanceState, int] | None:
        """The simulated instance at ``now`` read as ``residency_candidates.InstanceState`` and the budget in
        bytes (the active model's KV region: the arena minus its weights); None with no active model. A device
        session without a recorded write counts as used at ``now``. Pure read."""
        a = inst.active
        if a is None:
            return None
        cm = inst.profile.model(a)
        per_tok = cm.kv_bytes_per_token
        budget = max(0, inst.profile.arena_bytes - cm.weight_bytes)
        need = sum(c.prompt_tokens + c.output_tokens for c in inst.batch) + sum(c.ctx_needed + c.output_tokens for c in inst.queues[a])
        costs = inst.scheduler.costs
        cached = tuple(CachedPrefix(sid, m, tokens, tokens * per_tok, inst.device_used.get(sid, now), inst.host_tokens(m, sid) > 0)
                       for sid, (m, tokens) in inst.device.items())
        return InstanceState(a, need * per_tok, costs.prefill_per_token(a), costs.restore_per_token(a), cached, self._inactive(inst, a)), budget

    def _inactive(self, inst: SimInstance, active: str) -> tuple[InactiveModel, ...]:
        """Every loaded model but the active one: its queued calls, its startup prefix (k* with streaming
        hot-swap) and ``inst.groups`` equal layer groups (reload = one group's H2D copy; staged = the prefix
        its staged bytes cover)."""
        g = inst.groups
        copy = inst.group_copy_s()
        out = []
        for m in inst.loaded:
            if m == active:
                continue
            w = inst.profile.model(m).weight_bytes
            have = int(self.staged.get(m, 0.0) / max(1, w) * g + 1e-9)
            groups = tuple(GroupState(w // g, copy, j < have) for j in range(g))
            out.append(InactiveModel(m, len(inst.queues[m]), False, self._startup_prefix(inst, m), groups))
        return tuple(out)

    def _startup_prefix(self, inst: SimInstance, model: str) -> int:
        """k* of ``model`` with streaming hot-swap (``partial_layers``), else all groups: the engine's
        ``residency_candidates.startup_groups`` on this instance's first forward and the model's usual prompt."""
        k_for = (lambda t: inst.k_star(model, t)) if inst.partial_layers else None
        usual = self.prompt_tokens[model].value if model in self.prompt_tokens else None
        return startup_groups(inst.groups, k_for, lambda: inst.first_prefill_tokens(model), usual)

    def snapshot(self) -> dict:
        p = self.plan
        return {"plans": self.plans, "released_sessions": self.released_sessions,
                "staged_gib": {m: b / 2**30 for m, b in self.staged.items()},
                "target_bytes": p.target_bytes if p else 0, "budget_bytes": p.budget_bytes if p else 0}
