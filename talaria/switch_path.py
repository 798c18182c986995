"""The switch-cost contract between a cold-pool engine and the router (Talaria §3.4 S_{m→m'}, §3.3 Eq. 1).

A cold engine measures every model switch by the path its weights took (``SwitchPath``) and reports an EWMA
per path in its heartbeat (``CostProfile.switch_costs``); the router prices a model activation from the same
paths. ``SwitchPath`` mirrors the wire enum ``talaria.v1.SwitchPath`` one to one (a unit test checks it); its
string values are the keys used in records, round summaries and telemetry labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import cast

from talaria.ewma import ewma
from talaria.v1 import engine_pb2 as pb


class SwitchPath(StrEnum):
    FULL_STAGED = "full_staged"  # every weight chunk device-to-device from clean staged chunks
    PARTIAL = "partial"  # some chunks staged, the rest host-to-device
    HOST_ONLY = "host_only"  # nothing staged: every chunk host-to-device from the weight bank
    OPEN = "open"  # model not loaded: checkpoint -> host bank, then a host-only switch

    @property
    def proto(self) -> pb.SwitchPath:
        # (the generated stub types EnumTypeWrapper.Value as a plain int; it is this enum's value)
        return cast(pb.SwitchPath, pb.SwitchPath.Value("SWITCH_PATH_" + self.name))

    @classmethod
    def from_proto(cls, value: int) -> SwitchPath:
        """Raises ValueError for ``SWITCH_PATH_UNSPECIFIED`` or a value this build does not know."""
        name = pb.SwitchPath.Name(value)  # ValueError for an unknown number
        try:
            return cls[name.removeprefix("SWITCH_PATH_")]
        except KeyError:
            raise ValueError(f"switch path {name} has no cost") from None


def costs_to_proto(by_path: Mapping[SwitchPath, float]) -> list[pb.SwitchCost]:
    """The wire form of measured per-path seconds (paths in enum order; unmeasured paths left out)."""
    return [pb.SwitchCost(path=p.proto, seconds=by_path[p]) for p in SwitchPath if by_path.get(p, 0.0) > 0]


def costs_from_proto(costs: Iterable[pb.SwitchCost]) -> dict[SwitchPath, float]:
    """Measured per-path seconds from the wire; entries of unknown or unspecified paths are skipped."""
    out: dict[SwitchPath, float] = {}
    for c in costs:
        try:
            out[SwitchPath.from_proto(c.path)] = c.seconds
        except ValueError:
            continue
    return out


class SwitchCostModel:
    """The project's one switch-cost model: EWMA of measured switch seconds per load path and an estimate for
    a switch given its expected staged fraction (Talaria §3.4: S_{m→m'} from staging coverage). The cold
    engine keeps one (wall seconds, reported in the heartbeat's cost profile); the slot scheduler's cost
    model keeps one on its injected clock (``services/engine/slots/costs.py``), seeded with priors.

    ``OPEN`` (a model that is not loaded) is the measured bank load plus the host-only switch, so it is
    derived, never observed directly: ``observe_load`` records the load part."""

    def __init__(self, alpha: float = 0.2, priors: Mapping[SwitchPath | str, float] | None = None) -> None:
        self.alpha = alpha
        self._switch: dict[SwitchPath, float] = {SwitchPath(k): v for k, v in (priors or {}).items()}  # priors blend with the first samples
        self._load: float | None = None

    def get(self, path: SwitchPath) -> float | None:
        return self._switch.get(path)

    def observe(self, path: SwitchPath | str, seconds: float) -> None:
        """Mutates: the EWMA of ``path``."""
        path = SwitchPath(path)
        old = self._switch.get(path)
        self._switch[path] = ewma(old, seconds, self.alpha)

    def observe_load(self, seconds: float) -> None:
        """Mutates: the EWMA of loading a checkpoint into the host weight bank."""
        self._load = ewma(self._load, seconds, self.alpha)

    @property
    def by_path(self) -> dict[SwitchPath, float]:
        """Measured seconds per path (``OPEN`` once a load and a host-only switch were measured)."""
        out = dict(self._switch)
        host = self._switch.get(SwitchPath.HOST_ONLY)
        if self._load is not None and host is not None:
            out[SwitchPath.OPEN] = self._load + host
        return out

    def estimate(self, staged_fraction: float) -> float | None:
        full, host = self._switch.get(SwitchPath.FULL_STAGED), self._switch.get(SwitchPath.HOST_ONLY)
        if full is None or host is None:
            return full if host is None else host
        f = min(max(staged_fraction, 0.0), 1.0)
        return f * full + (1 - f) * host
