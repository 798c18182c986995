"""ProfileBook's peer borrowing kept in sorted per-group views (O(1) lookups at fleet scale) gives exactly what
the plain definition gives: for an unmeasured cost, the median of the group's other members' EWMAs; for a
missing curve, the most-sampled peer curve (ties: the smallest id); else the priors. Random observations,
group moves and forgets, checked against a brute-force reference after every operation."""

from __future__ import annotations

import random

from services.router.profiles import ProfileBook
from talaria.switch_path import SwitchPath

GROUPS = [(), (1, "cpu", ("a",)), (1, "cpu", ("b",)), (2, "cpu", ("a", "b"))]
NAMES = ("prefill_per_token", "decode_step", "restore_per_token", "switch_s", "open_s")


def _reference(book: ProfileBook, iid: str):
    """The definition, by scanning every instance (what the book did before its sorted views)."""
    group = book._group.get(iid, ())
    peers = sorted(j for j, g in book._group.items() if group and g == group and j != iid)
    v, d = book._v.get(iid, {}), book.defaults
    out = {}
    for name in NAMES:
        if name in v:
            out[name] = v[name]
            continue
        seen = sorted(book._v[j][name] for j in peers if name in book._v.get(j, {}))
        out[name] = seen[len(seen) // 2] if seen else getattr(d, name)
    best, most = None, 0
    for j in peers:
        c = book._curves.get(j, (None, None))[0]
        n = sum(p[2] for p in c.points()) if c is not None else 0
        if n > most:
            best, most = c, n
    own = book._curves.get(iid, (None, None))[0]
    return out, own or best


def test_sorted_group_views_match_the_definition_under_random_operations():
    rng = random.Random(7)
    book = ProfileBook()
    ids = [f"i{k}" for k in range(12)]
    for _ in range(600):
        iid = rng.choice(ids)
        if rng.random() < 0.08:
            book.forget(iid)
        else:
            pick = lambda: rng.choice([0.0, rng.uniform(1e-5, 1e-3)])  # noqa: E731 - 0 = not measured
            switch = {SwitchPath.HOST_ONLY: pick(), SwitchPath.OPEN: pick()}
            curve = [(64, rng.uniform(0.001, 0.01), rng.randint(1, 4))] if rng.random() < 0.5 else []
            book.observe(iid, pick(), pick(), pick(), switch, prefill_by_context=curve, group=rng.choice(GROUPS))
        for j in ids:
            p = book.profile(j)
            want, curve = _reference(book, j)
            got = {n: getattr(p, n) for n in NAMES}
            assert got == want, (j, got, want)
            assert p.prefill_by_context is curve, j
