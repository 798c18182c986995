"""Cold-pool round/slot scheduler with session-prefill (SP) admission (Talaria §3.4) — pure policy.

| module | owns |
|---|---|
| ``types.py`` | boundary data: ``InstanceView`` in, ``Decision`` out, ``RoundSummary`` |
| ``costs.py`` | EWMA-refreshed cost profile (prefill/token, decode step, restore/token, switch by path) |
| ``budget.py`` | Eq. 3-5: protected decode d_m, round bound γ·T_TTFT, prefill pool, shortfall |
| ``admission.py`` | P admission and SP eligibility / bounded SP batches / SP gain (benefit vs harm) |
| ``hold.py`` | holding an idle slot for returns the routers' leases expect, when the round wait saved beats the delay |
| ``scheduler.py`` | ``SlotScheduler.decide(view, now)``: rounds, slots, phases, summaries |
| ``deadlines.py`` | per-token deadlines (Aegaeon): ``DeadlineTracker`` (attainment, gap histogram) and ``DeadlineScheduler`` (token-granularity EDF switches and admission; ``token_deadlines``) |

No module here imports torch or does I/O; the clock is whatever ``now`` the caller passes.
"""

from .costs import CostModel, CostProfile
from .scheduler import SlotPolicy, SlotScheduler
from .types import CallView, Decision, InstanceView, ModelView, Phase, RoundPlan, RoundSummary, SpVerdict

__all__ = [
    "CallView", "CostModel", "CostProfile", "Decision", "InstanceView", "ModelView", "Phase", "RoundPlan",
    "RoundSummary", "SlotPolicy", "SlotScheduler", "SpVerdict",
]
