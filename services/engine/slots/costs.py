"""Measured, EWMA-refreshed cost profile the slot scheduler predicts with (Talaria §3.4: "costs come from
profiles, not constants"; the switch estimate follows staging coverage, §3.5).

Four quantities, per model where they depend on the model: prefill seconds per token, decode-step
seconds, restore seconds per token (host KV → device), switch seconds by load path
(``talaria.switch_path.SwitchPath``, the wire enum the router prices activation with). An injected :class:`CostProfile` seeds them; every
executed step and switch refreshes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from talaria.cost_curve import CostCurve, prefill_seconds
from talaria.ewma import ewma
from talaria.switch_path import SwitchCostModel, SwitchPath

from .types import CallView

PATHS = (SwitchPath.FULL_STAGED, SwitchPath.PARTIAL, SwitchPath.HOST_ONLY)


@dataclass(frozen=True, slots=True)
class CostProfile:
    prefill_per_token: float = 2e-4
    decode_step: float = 0.02
    restore_per_token: float = 2e-5
    switch_by_path: dict[SwitchPath, float] = field(default_factory=lambda: {SwitchPath.FULL_STAGED: 0.1, SwitchPath.PARTIAL: 0.5, SwitchPath.HOST_ONLY: 1.0})


@dataclass(frozen=True, slots=True)
class CallCost:
    prefill_tokens: int  # tokens to compute
    restore_tokens: int  # tokens whose KV is copied back from host
    kv_tokens: int  # new device KV tokens the call needs (prompt not on device + its output)
    seconds: float


class CostModel:
    def __init__(self, default: CostProfile | None = None, per_model: dict[str, CostProfile] | None = None, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.default = default or CostProfile()
        self._models: dict[str, CostProfile] = dict(per_model or {})
        self._switch = SwitchCostModel(alpha, priors=self.default.switch_by_path)  # the project's one switch-cost model
        self._prefill_curve: dict[str, CostCurve] = {}  # per model, seconds per token by context
        self._decode_curve: dict[str, CostCurve] = {}  # per model, decode-step seconds by batch size
        self._measured: set[str] = set()  # models with a measured step or restore (not only the injected priors)

    def _p(self, model: str) -> CostProfile:
        return self._models.get(model, self.default)

    # ---------------------------------------------------------------- predictions
    def prefill_per_token(self, model: str) -> float:
        return self._p(model).prefill_per_token

    def decode_step(self, model: str) -> float:
        return self._p(model).decode_step

    def restore_per_token(self, model: str) -> float:
        return self._p(model).restore_per_token

    def switch(self, path: SwitchPath) -> float:
        known = self._switch.by_path
        if path in known:
            return known[path]
        return known.get(SwitchPath.HOST_ONLY, max(known.values(), default=0.0))

    def call(self, c: CallView, host_kv: bool = True) -> CallCost:
        """Predicted prefill + restore of a queued call (its prefix reused from device, or restored from
        host when ``host_kv``, else recomputed)."""
        reuse = min(c.prefix_tokens, max(c.prompt_tokens - 1, 0))
        device = reuse if c.prefix_state == "device" else 0
        restore = reuse if c.prefix_state == "host" and host_kv else 0
        prefill = c.prompt_tokens - device - restore
        s = self.prefill_seconds(c.model, prefill, c.prompt_tokens) + restore * self.restore_per_token(c.model)
        return CallCost(prefill, restore, c.prompt_tokens - device + c.max_tokens, s)

    # ---------------------------------------------------------------- measurements
    def _ewma(self, old: float | None, new: float) -> float:
        return ewma(old, new, self.alpha)

    def observe_step(self, model: str, prefill_tokens: int, restore_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One executed step. Decode-only steps refresh t_D; steps that prefill without restoring refresh the
        prefill cost per token (after the decode share); steps that restore refresh the restore cost per
        token (after the decode and predicted prefill shares) — each quantity from the steps that identify it."""
        p = self._p(model)
        rest = seconds - (p.decode_step if decode_seqs else 0.0)
        if prefill_tokens == 0 and restore_tokens == 0:
            if decode_seqs > 0:
                p = replace(p, decode_step=self._ewma(p.decode_step, seconds))
        elif restore_tokens == 0:
            p = replace(p, prefill_per_token=self._ewma(p.prefill_per_token, max(rest, 0.0) / prefill_tokens))
        else:
            rest -= prefill_tokens * p.prefill_per_token
            p = replace(p, restore_per_token=self._ewma(p.restore_per_token, max(rest, 0.0) / restore_tokens))
        self._models[model] = p
        self._measured.add(model)

    def observe_restore(self, model: str, tokens: int, seconds: float) -> None:
        """One real host KV restore of ``tokens`` tokens that took ``seconds`` (it runs off the executor
        thread, beside the steps): refreshes the restore cost per token."""
        if tokens > 0:
            p = self._p(model)
            self._models[model] = replace(p, restore_per_token=self._ewma(p.restore_per_token, seconds / tokens))
            self._measured.add(model)

    def measured(self, model: str) -> bool:
        """Whether a step or restore of ``model`` has been measured (its costs are more than the priors)."""
        return model in self._measured

    # ---------------------------------------------------------------- learned curves
    def prefill_seconds(self, model: str, tokens: int, context_end: int) -> float:
        """Seconds to prefill ``tokens`` tokens ending at ``context_end``: the learned per-token curve at
        their mean position once measured, else ``tokens * prefill_per_token`` (the prior / scalar EWMA)."""
        return prefill_seconds(self._prefill_curve.get(model), self.prefill_per_token(model), tokens, context_end)

    def decode_step_at(self, model: str, batch: int) -> float:
        """Decode-step seconds with ``batch`` sequences: the learned curve once measured, else ``decode_step``."""
        c = self._decode_curve.get(model)
        return c.value(max(1, batch)) if c is not None and c.measured else self.decode_step(model)

    def observe_shape(self, model: str, prefill_tokens: int, prefill_position: float, restore_tokens: int, decode_seqs: int, seconds: float) -> None:
        """The step of ``observe_step`` by its shape: a decode-only step refreshes the decode step at its batch
        size; a step that prefills (and restores nothing: a restore's copy would be charged to prefill)
        refreshes the per-token prefill cost at the chunks' mean ``prefill_position``, after the decode share.
        Mutates: the model's curves."""
        dc = self._decode_curve.setdefault(model, CostCurve(self.decode_step(model), self.alpha))
        if prefill_tokens == 0 and restore_tokens == 0:
            if decode_seqs > 0:
                dc.observe(decode_seqs, seconds)
            return
        if restore_tokens or prefill_tokens <= 0:
            return
        rest = seconds - (self.decode_step_at(model, decode_seqs) if decode_seqs else 0.0)
        if rest <= 0:
            return  # no slower than its decodes alone: the step does not identify the prefill cost
        pc = self._prefill_curve.setdefault(model, CostCurve(self.prefill_per_token(model), self.alpha))
        pc.observe(prefill_position, rest / prefill_tokens)

    def curves(self, model: str) -> dict[str, list[tuple[int, float, int]]]:
        """The learned buckets of ``model`` (``talaria.cost_curve.CostCurve.points``)."""
        p, d = self._prefill_curve.get(model), self._decode_curve.get(model)
        return {"prefill_by_context": p.points() if p else [], "decode_by_batch": d.points() if d else []}

    def observe_switch(self, path: SwitchPath, seconds: float) -> None:
        self._switch.observe(path, seconds)

    def snapshot(self, model: str | None = None) -> dict:
        p = self._p(model) if model else self.default
        return {
            "prefill_per_token": p.prefill_per_token, "decode_step": p.decode_step,
            "restore_per_token": p.restore_per_token, "switch_by_path": self._switch.by_path,
            **(self.curves(model) if model else {}),
        }


def expected_path(staged_fraction: float | None, d2d_staging: bool) -> SwitchPath:
    """The load path a switch to a model is expected to take (Talaria §3.5): without D2D staging always
    host-only; with it, by how much of the target is staged (unknown: assume staged, the engine stages the
    predicted next model while the active one serves)."""
    if not d2d_staging:
        return SwitchPath.HOST_ONLY
    f = 1.0 if staged_fraction is None else staged_fraction
    if f >= 1.0:
        return SwitchPath.FULL_STAGED
    return SwitchPath.HOST_ONLY if f <= 0.0 else SwitchPath.PARTIAL


class MeasuredCosts:
    """What a cold-pool scheduler learns from its executor (``SlotScheduler`` and ``DeadlineScheduler`` both):
    every observation goes to its ``costs`` model. Mutates ``self.costs``."""

    costs: CostModel

    def observe_step(self, model: str, prefill_tokens: int, restore_tokens: int, decode_seqs: int, seconds: float) -> None:
        self.costs.observe_step(model, prefill_tokens, restore_tokens, decode_seqs, seconds)

    def observe_restore(self, model: str, tokens: int, seconds: float) -> None:
        """One real host KV restore (it runs off the executor thread, beside the steps)."""
        self.costs.observe_restore(model, tokens, seconds)

    def observe_shape(self, model: str, prefill_tokens: int, prefill_position: float, restore_tokens: int, decode_seqs: int, seconds: float) -> None:
        """The learned curves' part of a measured step (``CostModel.observe_shape``)."""
        self.costs.observe_shape(model, prefill_tokens, prefill_position, restore_tokens, decode_seqs, seconds)
