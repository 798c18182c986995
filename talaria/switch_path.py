"""The switch-cost contract between a cold-pool engine and the router (Talaria §3.4 S_{m→m'}, §3.3 Eq. 1).

A cold engine measures every model switch by the path its weights took (``SwitchPath``) and reports an EWMA
per path in its heartbeat (``CostProfile.switch_costs``); the router prices a model activation from the same
paths. ``SwitchPath`` mirrors the wire enum ``talaria.v1.SwitchPath`` one to one (a unit test checks it); its
string values are the keys used in records, round summaries and telemetry labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from talaria.v1 import engine_pb2 as pb


class SwitchPath(StrEnum):
    FULL_STAGED = "full_staged"  # every weight chunk device-to-device from clean staged chunks
    PARTIAL = "partial"  # some chunks staged, the rest host-to-device
    HOST_ONLY = "host_only"  # nothing staged: every chunk host-to-device from the weight bank
    OPEN = "open"  # model not loaded: checkpoint -> host bank, then a host-only switch

    @property
    def proto(self) -> int:
        return pb.SwitchPath.Value("SWITCH_PATH_" + self.name)

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
