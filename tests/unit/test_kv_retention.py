"""Retention tied to the predicted return (issue 14 item 2): the session cache evicts by the decaying value of
a session's return (services/engine/kv/retention.py), never pins, and without hints stays LRU."""

from __future__ import annotations

import math

from services.engine.kv.allocator import PageAllocator
from services.engine.kv.manager import KVManager
from services.engine.kv.retention import Hint, RetentionBook
from services.engine.kv.session_cache import SessionCache
from services.engine.tool_watch import ToolWatch


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def soon(t_done):  # an `ls`: median 50 ms, window 100 ms
    return Hint(t_done, math.log(0.05), 0.25, 0.1)


def later(t_done):  # a test run: median 6 s; window capped at 2 s -> return expected after it
    return Hint(t_done, math.log(6.0), 0.8, 2.0)


def test_eviction_order_follows_the_predicted_return():
    wall = Clock()
    book = RetentionBook(wall)
    a = PageAllocator(16)
    s = SessionCache(a, Clock(), max_entries=8)
    s.retention = book
    for sid in ("old-unhinted", "soon", "later", "no-lease"):
        s.put(sid, [1] * 4, a.allocate(1))
    book.note("soon", soon(0.0))
    book.note("later", later(0.0))
    book.note("no-lease", Hint(0.0, 0.0, 0.0, 0.0))
    wall.t = 0.02
    order = []
    while len(s):
        before = set(e.session_id for e in s.entries())
        s.evict_lru()
        order.append((before - set(e.session_id for e in s.entries())).pop())
    # expected after the window first (LRU among them), then the unhinted LRU, the live one last
    assert order == ["later", "no-lease", "old-unhinted", "soon"]
    assert a.num_free == 16  # nothing pinned: all could go
    assert book.counters["evicted_after_window"] == 2 and book.counters["evicted_live"] == 1


def test_a_spent_hint_yields_like_an_unhinted_entry():
    wall = Clock()
    book = RetentionBook(wall)
    book.note("s", soon(0.0))
    assert book.value("s", 0.0) > 0.9
    assert 0 < book.value("s", 0.08) < book.value("s", 0.03)  # decays
    assert book.value("s", 0.2) == 0.0  # window over: spent
    wall.t = 0.2
    assert book.victim(["s", "x"]) == "s"  # LRU among equals


def test_memory_pressure_evicts_the_decayed_session_first():
    """The KV manager's ensure_free under pressure: the live session survives as long as something else can go."""
    wall = Clock()
    book = RetentionBook(wall)
    kv = KVManager(6, 4, clock=Clock())
    kv.sessions.retention = book
    kv.sessions.put("soon", [1] * 8, kv.allocator.allocate(2))
    kv.sessions.put("decayed", [2] * 8, kv.allocator.allocate(2))
    book.note("soon", soon(0.0))
    book.note("decayed", soon(-10.0))
    assert kv.ensure_free(4)
    assert "soon" in kv.sessions and "decayed" not in kv.sessions
    assert kv.ensure_free(6)  # more pressure: the live one yields too (never a hard pin)
    assert len(kv.sessions) == 0


def test_without_hints_the_cache_stays_lru():
    a = PageAllocator(8)
    s = SessionCache(a, Clock(), max_entries=2)
    s.retention = RetentionBook(Clock())
    s.put("a", [1] * 4, a.allocate(1))
    s.put("b", [1] * 4, a.allocate(1))
    s.put("c", [1] * 4, a.allocate(1))
    assert [e.session_id for e in s.entries()] == ["b", "c"]


def test_tool_watch_reports_the_header_once_and_the_names_at_the_end():
    w = ToolWatch("hermes")
    out = 'Let me look.<tool_call>\n{"name": "grep", "arguments": {"pattern": "x"}}\n</tool_call>'
    seen = [w.feed(out[i : i + 7], i) for i in range(0, len(out), 7)]
    assert [n for n in seen if n] == ["grep"]
    assert w.intent == "grep" and w.finish() == ["grep"]
    plain = ToolWatch("hermes")
    assert plain.feed("no tools here") == "" and plain.finish() == []
    broken = ToolWatch("hermes")
    broken.feed('<tool_call>\n{"name": "ls", "arguments": {oops')
    assert broken.finish() == []  # a claimed call that does not parse is plain text, never an error
