"""Per-session completion time (SCT), Talaria §5.1: from a session's first call arrival to its last
response. Pure: times are passed in (wall-clock seconds), nothing is read from a clock here.

A session is open while it has a call in flight or its last response is younger than ``idle_s``; then it
ends and its SCT is final. A call that started but never reported its end (a router that died) stops
holding the session open after ``inflight_timeout_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Open:
    session_id: str
    first_arrival: float
    last_end: float = 0.0
    last_activity: float = 0.0
    calls: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    models: set[str] = field(default_factory=set)
    instances: set[str] = field(default_factory=set)
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> start
    done: set[str] = field(default_factory=set)  # request ids already counted
    attribution: dict[str, float] = field(default_factory=dict)  # seconds per component, summed over calls
    attributed: set[str] = field(default_factory=set)  # request ids whose attribution is in the sum


@dataclass(frozen=True, slots=True)
class SessionResult:
    session_id: str
    first_arrival_unix: float
    last_response_unix: float
    sct_seconds: float
    calls: int
    errors: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    models: tuple[str, ...]
    instances: tuple[str, ...]
    attribution: dict[str, float] = field(default_factory=dict)  # the calls' time split, summed

    def as_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "first_arrival_unix": self.first_arrival_unix,
            "last_response_unix": self.last_response_unix,
            "sct_seconds": self.sct_seconds,
            "calls": self.calls,
            "errors": self.errors,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "models": list(self.models),
            "instances": list(self.instances),
            "attribution": dict(self.attribution),
        }


class SessionTracker:
    def __init__(self, idle_s: float, inflight_timeout_s: float = 900.0, keep_finished: int = 10000):
        self.idle_s = idle_s
        self.inflight_timeout_s = inflight_timeout_s
        self.keep_finished = keep_finished
        self.open: dict[str, _Open] = {}
        self.finished: list[SessionResult] = []
        self._closed_calls: OrderedDict[str, None] = OrderedDict()  # calls of ended sessions (late duplicates)

    def _get(self, session_id: str, arrival: float) -> _Open:
        s = self.open.get(session_id)
        if s is None:
            s = self.open[session_id] = _Open(session_id, arrival)
        s.first_arrival = min(s.first_arrival, arrival)
        return s

    def call_started(self, session_id: str, request_id: str, arrival: float, now: float) -> None:
        if not session_id:
            return
        s = self._get(session_id, arrival)
        if request_id not in s.done:
            s.in_flight[request_id] = arrival
        s.last_activity = max(s.last_activity, now)

    def call_ended(
        self,
        session_id: str,
        request_id: str,
        arrival: float,
        end: float,
        now: float,
        *,
        model: str = "",
        instance: str = "",
        error: bool = False,
        tokens: tuple[int, int, int] | None = None,
    ) -> None:
        """One call's end. Reported twice for the same request (router record and engine hook) it counts
        once; the window still takes the earliest arrival and the latest end of both reports."""
        if not session_id or request_id in self._closed_calls:
            return
        s = self._get(session_id, arrival)
        s.in_flight.pop(request_id, None)
        s.last_end = max(s.last_end, end)
        s.last_activity = max(s.last_activity, now)
        if model:
            s.models.add(model)
        if instance:
            s.instances.add(instance)
        if request_id in s.done:
            return
        s.done.add(request_id)
        s.calls += 1
        s.errors += int(error)
        if tokens is not None:
            s.input_tokens += tokens[0]
            s.output_tokens += tokens[1]
            s.cached_tokens += tokens[2]

    def call_attribution(self, session_id: str, request_id: str, arrival: float, seconds: dict[str, float]) -> None:
        """Add one call's time split (``talaria.attribution.CallAttribution`` fields) to its session's sum;
        a second report of the same call is ignored. Mutates: the open session."""
        if not session_id or request_id in self._closed_calls:
            return
        s = self._get(session_id, arrival)
        if request_id in s.attributed:
            return
        s.attributed.add(request_id)
        for k, v in seconds.items():
            s.attribution[k] = s.attribution.get(k, 0.0) + float(v)

    def expire(self, now: float) -> list[SessionResult]:
        """Sessions idle for ``idle_s`` (no call in flight) end now; returns their results."""
        out: list[SessionResult] = []
        for sid, s in list(self.open.items()):
            for rid, t in list(s.in_flight.items()):
                if now - t > self.inflight_timeout_s:
                    del s.in_flight[rid]
            if s.in_flight or now - max(s.last_end, s.last_activity) < self.idle_s:
                continue
            del self.open[sid]
            for rid in s.done:
                self._closed_calls[rid] = None
            while len(self._closed_calls) > 4 * self.keep_finished:
                self._closed_calls.popitem(last=False)
            if s.calls == 0:
                continue
            r = SessionResult(
                sid,
                s.first_arrival,
                s.last_end,
                max(0.0, s.last_end - s.first_arrival),
                s.calls,
                s.errors,
                s.input_tokens,
                s.output_tokens,
                s.cached_tokens,
                tuple(sorted(s.models)),
                tuple(sorted(s.instances)),
                dict(s.attribution),
            )
            out.append(r)
        self.finished.extend(out)
        del self.finished[: -self.keep_finished]
        return out

    @property
    def calls_in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self.open.values())
