"""Retention of a session's device KV tied to its predicted return.

Design note (Talaria §3.3 leases made adaptive; SGLang's decaying soft retention -- a hard TTL pin there was
reverted for wedging memory; Continuum's per-tool KV time-to-live). The router knows what the engine does
not: the tool a call invoked and how long such a tool keeps a session away (``services/router/return_gap``).
After judging a lease it sends the engine holding the session's KV a ``RetentionHint`` (subject
``<ns>.engine.<instance>.retention``): the log-normal gap ``(mu, sigma)``, the call's end and the lease window
(0 = the router installed no lease). Why a message from the router rather than the same predictor in the
engine: the gap is only observed where the session's *next* call lands, which is any instance, and only the
router sees every return; one predictor, one truth, and the engine's part stays a few lines.

The session cache evicts by value instead of pure recency. A hinted entry is worth the probability that its
return still comes within its window given it has not come yet, ``P(gap <= w | gap > elapsed)`` -- high
right after the call, decaying to 0 at the window's end. Victims, in order: entries whose return is expected
*after* the window (no lease, or a return unlikely within it: under write-back the host tier writes such a
dirty session back as soon as the hint arrives -- ``HostKV._hinted_write_backs``, ``kv/write_back.py`` -- and
any dirty page is written before it is freed, so they may leave the device), then
unhinted entries and hinted ones whose value is spent, least recently used first, then live hinted entries,
lowest value first. Never a hard pin: when memory is needed every entry can go, a decayed one first.

Pure (no I/O, no torch); the clock (wall time, the hints' time base) is injected. ``note`` is called from the
NATS loop and ``victim`` from the executor thread: a dict assignment/read under the GIL, no lock needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from talaria.return_prob import lognormal_cdf, p_back_by

AFTER_WINDOW_P = 0.5  # a return less likely than this within the window is "expected after it"


@dataclass(frozen=True, slots=True)
class Hint:
    t_done_unix: float
    gap_mu: float
    gap_sigma: float  # 0: a fixed-tau lease (full value until the window ends)
    window_s: float  # 0: no lease was installed
    model: str = ""  # the session's model (a cold instance's slot scheduler holds its slot for it: slots/hold.py)


class RetentionBook:
    """Per-session retention hints and the eviction order they imply. Bounded (oldest hints dropped)."""

    def __init__(self, wall: Callable[[], float], max_hints: int = 4096) -> None:
        self._wall = wall
        self.max_hints = max_hints
        self._hints: OrderedDict[str, Hint] = OrderedDict()
        self.counters = {"hints": 0, "evicted_after_window": 0, "evicted_live": 0, "evicted_spent": 0}

    def note(self, session_id: str, hint: Hint) -> None:
        """Record the latest hint of a session (mutates)."""
        self._hints.pop(session_id, None)
        self._hints[session_id] = hint
        self.counters["hints"] += 1
        while len(self._hints) > self.max_hints:
            self._hints.popitem(last=False)

    def value(self, session_id: str, now: float) -> float:
        """-1: return expected after the window (first to go); 0: no hint or value spent; else P(return
        within the window | not yet)."""
        h = self._hints.get(session_id)
        if h is None:
            return 0.0
        if h.window_s <= 0:
            return -1.0
        elapsed = now - h.t_done_unix
        if elapsed >= h.window_s:
            return 0.0
        if h.gap_sigma <= 0:
            return 1.0
        if lognormal_cdf(h.gap_mu, h.gap_sigma, h.window_s) < AFTER_WINDOW_P:
            return -1.0
        return p_back_by(h.gap_mu, h.gap_sigma, max(0.0, elapsed), h.window_s)

    def victim(self, lru_order: Iterable[str], protect: str | None = None) -> str | None:
        """The entry to evict: lowest value, least recently used among equals (``lru_order``: LRU first).
        Counts which kind of entry went (mutates counters)."""
        now = self._wall()
        best: tuple[float, int, str] | None = None
        for i, sid in enumerate(lru_order):
            if sid == protect:
                continue
            v = self.value(sid, now)
            if best is None or (v, i) < best[:2]:
                best = (v, i, sid)
        if best is None:
            return None
        v = best[0]
        self.counters["evicted_after_window" if v < 0 else ("evicted_spent" if v == 0 else "evicted_live")] += 1
        self._hints.pop(best[2], None)
        return best[2]

    def wall(self) -> float:
        """The hints' time base now (the injected wall clock)."""
        return self._wall()

    def leased(self) -> list[tuple[str, Hint, float]]:
        """(session, hint, seconds since its call ended) of every hint whose lease window is still open, now
        on the injected wall clock; any thread (a snapshot of the dict, read under the GIL). Pure read."""
        now = self._wall()
        return [(sid, h, now - h.t_done_unix) for sid, h in list(self._hints.items()) if 0 <= now - h.t_done_unix < h.window_s]

    def forget(self, session_id: str) -> None:
        self._hints.pop(session_id, None)
