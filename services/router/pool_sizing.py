"""Hot/cold pool sizing from telemetry: which instances move between the hot and the cold pool.

Design NOTE. Talaria configures pool membership at deployment time and leaves "dynamic hot-cold pool
reallocation" to future work (§3.2, §7): "the telemetry used for placement could also drive promotion and
demotion". This is that controller, kept pure (inputs in, moves out; injected clock; no I/O) so the router
or an operator loop can run it and the simulator (``sim/scale.py``) drives the same object.

Signal: a model's *offered work* in instance-seconds per second, ``rate x work per call``, from what the
router already measures: the arrival rate (``profiles.DemandMeter``), the typical call (``ShapeBook``: uncached
suffix and decode tokens) and the instances' measured per-token costs (``ProfileBook`` via heartbeats). A
hot instance pins one model and never switches (§3.2), so a model deserves ``ceil(work / target_util)`` hot
instances when that is at least one; the rest of the catalog time-shares the cold pool.

Rules, each period:
* **promote** the model whose offered work most exceeds its hot capacity (``work > promote_util x hot``),
  taking an idle cold instance (one that has the model loaded first); the cold pool keeps ``min_cold``;
* **demote** a hot instance whose model's work would still fit on the remaining hot instances at
  ``demote_util`` (the last one: below half of it; hysteresis: ``demote_util < promote_util``), idle only;
* at most ``max_moves`` per period, and an instance that moved waits ``cooldown_s`` before moving again
  (a move costs an open and loses device KV).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolParams:
    period_s: float = 30.0
    promote_util: float = 0.9  # promote when work > promote_util x hot instances (and >= promote_util)
    demote_util: float = 0.4  # demote when work < demote_util x (hot instances - 1), or < demote_util / 2 for the last
    min_cold: int = 1
    max_moves: int = 4
    cooldown_s: float = 120.0


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    instance_id: str
    pool: str  # "hot" | "cold"
    models: tuple[str, ...]  # hot: the pinned model; cold: the loaded ones
    idle: bool  # nothing running or queued: can move now


@dataclass(frozen=True, slots=True)
class Move:
    instance_id: str
    to_pool: str
    model: str | None  # the model a promoted instance pins; None for a demotion
    reason: str


class PoolSizer:
    """Decides moves from offered work per model. Mutates only its own cooldown record (``decide``)."""

    def __init__(self, params: PoolParams, clock: Callable[[], float]) -> None:
        self.params = params
        self.clock = clock
        self._moved: dict[str, float] = {}
        self.moves: list[Move] = []

    def _cool(self, iid: str, now: float) -> bool:
        t = self._moved.get(iid)
        return t is None or now - t >= self.params.cooldown_s

    def decide(self, work: Mapping[str, float], instances: Sequence[InstanceInfo]) -> list[Move]:
        """``work``: offered instance-seconds per second per model. Returns the moves (and records them)."""
        p, now = self.params, self.clock()
        hot: dict[str, list[InstanceInfo]] = {}
        cold = [i for i in instances if i.pool == "cold"]
        for i in instances:
            if i.pool == "hot" and i.models:
                hot.setdefault(i.models[0], []).append(i)
        moves: list[Move] = []
        taken: set[str] = set()
        # demotions first: they return capacity the promotions may use in the same period
        for m, insts in sorted(hot.items()):
            w = work.get(m, 0.0)
            n = len(insts)
            # the work would still fit the other n-1 at demote_util; the last one goes below half of it
            if w < p.demote_util * (n - 1) or (n == 1 and w < p.demote_util / 2):
                cand = [i for i in insts if i.idle and self._cool(i.instance_id, now)]
                if cand and len(moves) < p.max_moves:
                    i = cand[0]
                    moves.append(Move(i.instance_id, "cold", None, f"demote {m}: work {w:.2f} for {n} hot"))
                    taken.add(i.instance_id)
        n_cold = len(cold) + len(moves)
        gaps = sorted(((work.get(m, 0.0) - p.promote_util * len(hot.get(m, ())), m) for m in work), reverse=True)
        for gap, m in gaps:
            if len(moves) >= p.max_moves or gap <= 0:
                break
            if work[m] < p.promote_util:  # not one instance's worth: the cold pool serves it
                continue
            free = [i for i in cold if i.idle and i.instance_id not in taken and self._cool(i.instance_id, now)]
            if n_cold - 1 < p.min_cold or not free:
                break
            free.sort(key=lambda i: (m not in i.models, i.instance_id))
            i = free[0]
            moves.append(Move(i.instance_id, "hot", m, f"promote {m}: work {work[m]:.2f} over {len(hot.get(m, ()))} hot"))
            taken.add(i.instance_id)
            n_cold -= 1
        for mv in moves:
            self._moved[mv.instance_id] = now
        self.moves += moves
        return moves


def offered_work(rate: Mapping[str, float], suffix_tokens: Mapping[str, float], decode_tokens: Mapping[str, float],
                 prefill_per_token: float, decode_step: float, batch: float = 1.0) -> dict[str, float]:
    """Instance-seconds per second each model offers: ``rate x (suffix x prefill/token + decode x step / batch)``
    (``batch``: decode sequences sharing a step; 1 is the conservative bound). Pure."""
    return {m: r * (suffix_tokens.get(m, 0.0) * prefill_per_token + decode_tokens.get(m, 0.0) * decode_step / max(1.0, batch))
            for m, r in rate.items()}
