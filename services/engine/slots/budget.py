"""Round budgets: protected decode (Eq. 4), the round bound (Eq. 5), and what prefill and SP may share.

Talaria §3.4. A round on an instance is (Eq. 3)

    R = Σ_m [P_m + D1_m + Σ_k (SP_m,k + D_m,k) + Dfin_m] + Σ S_{m→m'}.

For model m with d_m decode iterations of t_D,m each, U_m = R − d_m·t_D,m is everything in the round
that is not m's decode; a sequence active through the round sees R/d_m per token on average, and keeping
that under T_TPOT is ``d_m·(T_TPOT − t_D,m) ≥ U_m`` (Eq. 4; equivalently d_m·T_TPOT ≥ R). With the round
bounded by ``R ≤ γ·T_TTFT`` (Eq. 5, γ < 1, Appendix E), the smallest reservation that satisfies Eq. 4 for
every U_m the bound allows is ``d_m = ⌈γ·T_TTFT / T_TPOT⌉``. When ``t_D,m ≥ T_TPOT`` no d_m satisfies Eq. 4:
the model is reported infeasible (its decode still gets d_m iterations, best effort).

Protected decode is reserved first; prefill (P) and session-prefill (SP) share only
``γ·T_TTFT − Σ d_m·t_D,m − Σ S``. When the waiting prefill does not fit (or nothing is left), the plan
carries the shortfall so the instance reports deadline risk instead of silently rolling work over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .costs import CostModel
from .types import RoundPlan


def reserved_iterations(bound_s: float, tpot_s: float) -> int:
    """d_m: the fewest decode iterations per round for which Eq. 4 holds for every U_m the round bound
    allows (U_m ≤ bound − d_m·t_D,m, so Eq. 4 becomes d_m·T_TPOT ≥ bound)."""
    if tpot_s <= 0:
        raise ValueError("T_TPOT must be positive")
    return max(1, math.ceil(bound_s / tpot_s - 1e-9))


def eq4_holds(d: int, tpot_s: float, t_decode_s: float, u_s: float) -> bool:
    """Eq. 4 for one model: d·(T_TPOT − t_D) ≥ U, U = predicted round time not spent on this model's decode."""
    return d * (tpot_s - t_decode_s) >= u_s - 1e-12


def plan_round(
    models: Sequence[str],
    *,
    costs: CostModel,
    ttft_s: float,
    tpot_s: float,
    gamma: float,
    switch_paths: Sequence[str],
    queued_prefill_s: float = 0.0,
) -> RoundPlan:
    """Budgets of a round over ``models`` (in slot order). ``switch_paths``: expected path of every switch
    the round will make (empty when the first model is already active and only one model is served)."""
    if not 0 < gamma < 1:
        raise ValueError("gamma must be in (0, 1) (Talaria Eq. 5, Appendix E)")
    bound = gamma * ttft_s
    t_d = {m: costs.decode_step(m) for m in models}
    d = reserved_iterations(bound, tpot_s)
    reserved = {m: d for m in models}
    decode_s = sum(reserved[m] * t_d[m] for m in models)
    switch_s = sum(costs.switch(p) for p in switch_paths)
    pool = bound - decode_s - switch_s
    predicted = decode_s + switch_s + queued_prefill_s
    infeasible = tuple(m for m in models if t_d[m] >= tpot_s)
    return RoundPlan(
        bound_s=bound, models=tuple(models), decode_step_s=t_d, reserved_iters=reserved, decode_reserved_s=decode_s,
        switch_s=switch_s, prefill_pool_s=pool, queued_prefill_s=queued_prefill_s, predicted_s=predicted,
        shortfall_s=max(0.0, predicted - bound), infeasible=infeasible,
    )
