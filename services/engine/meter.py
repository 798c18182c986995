"""The meter of one engine: what its steps cost, learned from the steps it runs.

Design note. The router's placement (Eq. 1), the slot scheduler and the host KV tier's restore-or-recompute
choice price work by this engine's measured costs; those measurements are one concern, apart from running the
step (``model_runner``) and from building outputs (``output_processor``), as vLLM keeps its stats loggers
apart from the engine core's loop. :class:`Meter` owns the costs: the EWMAs of prefill seconds per token and
of the decode step, the curves by size (``talaria.cost_curve.CostCurve``: prefill per token by context
position, decode step by batch size) and the recent samples fed to them. The loop calls :meth:`Meter.record`
once per step that ran a forward, after it; readers on other threads read single floats or build
``CostStats`` from copies (each value read once, possibly from either side of a step).

What it mutates: only itself, in ``record``; everything else reads.
"""

from __future__ import annotations

from collections import deque

from services.engine.api import CostStats
from services.engine.scheduler import SchedulerOutput
from talaria.cost_curve import CostCurve
from talaria.ewma import ewma

ALPHA = 0.2  # weight of the newest step in the prefill-per-token and decode-step EWMAs


class Meter:
    """Measured step costs of one engine (written by the executor thread, read from any thread)."""

    def __init__(self) -> None:
        self.prefill_per_token = 0.0  # seconds per prefill token (0.0 = not measured yet)
        self.decode_step = 0.0  # seconds per decode-only step (0.0 = not measured yet)
        # prefill seconds per token by context position, decode-step seconds by batch size
        self.prefill_curve = CostCurve(0.0)
        self.decode_curve = CostCurve(0.0)
        self.step_samples: deque[tuple[str, float, float]] = deque(maxlen=256)  # (curve, size, seconds) fed

    def record(self, sched: SchedulerOutput, dt: float) -> None:
        """One step of ``sched`` took ``dt`` seconds (forward and sampling). Mutates the EWMAs, the curves and
        ``step_samples``."""
        if all(sc.is_decode for sc in sched.scheduled):
            self.decode_step = ewma(self.decode_step or None, dt, ALPHA)
        else:
            self.prefill_per_token = ewma(self.prefill_per_token or None, dt / max(sched.num_batched_tokens, 1), ALPHA)
        self._record_curves(sched, dt)

    def _record_curves(self, sched: SchedulerOutput, dt: float) -> None:
        """A decode-only step measures the decode step at its batch size; a step that prefills
        measures the prefill cost per token at the token-weighted mean position of its prefill chunks, after
        the decode share predicted for its decodes. Mutates: the curves and ``step_samples``."""
        decodes = sum(1 for sc in sched.scheduled if sc.is_decode)
        pre = [sc for sc in sched.scheduled if not sc.is_decode]
        if not pre:
            self.decode_curve.observe(decodes, dt)
            self.step_samples.append(("decode", float(decodes), dt))
            return
        tokens = sum(sc.num_new_tokens for sc in pre)
        pos = sum(sc.num_new_tokens * (sc.start + sc.num_new_tokens / 2) for sc in pre) / tokens
        rest = dt - (self.decode_curve.value(decodes) if decodes else 0.0)
        if rest <= 0:
            return  # the step was no slower than its decodes alone: it does not identify the prefill cost
        per_token = rest / tokens
        self.prefill_curve.observe(pos, per_token)
        self.step_samples.append(("prefill", pos, per_token))

    def cost_stats(self, restore_per_token: float = 0.0) -> CostStats:
        """Measured prefill / decode costs with the host tier's ``restore_per_token`` (0.0 = not measured
        yet). Reads only."""
        return CostStats(self.prefill_per_token, self.decode_step, restore_per_token,
                         prefill_by_context=tuple(self.prefill_curve.points()), decode_by_batch=tuple(self.decode_curve.points()))
