"""The host store keeps live sessions over finished ones: ``ValuePerByte``'s reuse likelihood decays with the
re-access gaps the store observes, not with a fixed half-life.

Under a cold engine (every return restored from the store) with the store full, sessions that had finished a
couple of minutes earlier kept their pages (a page read seven times and idle two minutes was worth
``8 · 2^(-120/60) = 2`` with the fixed 60 s half-life) while a new session's first pages (worth ~1) were
evicted, and that session's next call found 0 cached tokens. Pure registry test, virtual clock: agent rounds of
sessions whose calls read their whole chain and append to it every ~2 s."""

from __future__ import annotations

import random

from services.kvstore.registry import Family, HostKVRegistry, Layout, ValuePerByte
from talaria.return_prob import LogGapFit

PAGE_BYTES = 4096


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


LAY = Layout("m@r1", 0, 1, 16, "float32", Family.MHA, (2, 2, 16, 2, 8), PAGE_BYTES)


def _round(r: HostKVRegistry, clock: Clock, rnd: int, sessions: int, calls: int, pages_per_call: int, rng: random.Random) -> int:
    """``sessions`` sessions run ``calls`` calls each, interleaved, a gap of 1-3 s between calls of a session:
    each call reads the session's chain (a restore) and then writes it grown by ``pages_per_call`` pages.
    Returns how many calls found less than their whole stored chain."""
    chains: dict[int, list[int]] = {s: [] for s in range(sessions)}
    short = 0
    for k in range(calls):
        for s in range(sessions):
            clock.t += rng.uniform(1.0, 3.0) / sessions
            chain = chains[s]
            if chain and r.lookup(LAY, chain).pages < len(chain):
                short += 1
            base = (rnd * 1000 + s) * 1000
            chain.extend(base + len(chain) + i for i in range(pages_per_call))
            res = r.reserve(LAY, chain)
            r.commit(res.lease_id, [b.block_id for b in res.blocks])
    return short


def _lost_returns(policy: ValuePerByte) -> tuple[int, int]:
    """Three rounds of 6 sessions x 8 calls, two minutes apart, into a store that holds about one round: the
    returns of rounds 2 and 3 that found less than their own earlier pages."""
    clock, rng = Clock(), random.Random(7)
    r = HostKVRegistry(6 * 8 * 3 * PAGE_BYTES + 24 * PAGE_BYTES, 1024, clock=clock, policy=policy)
    lost = []
    for rnd in range(3):
        lost.append(_round(r, clock, rnd, sessions=6, calls=8, pages_per_call=3, rng=rng))
        clock.t += 120.0
    r.check_integrity()
    return lost[1], lost[2]


def test_live_sessions_outlive_finished_ones():
    policy = ValuePerByte()
    assert _lost_returns(policy) == (0, 0)
    assert policy.gaps.ready and 0.5 < policy.gaps.quantile(0.5) < 4.0, "the learned gaps are the sessions' ~2 s returns"


def test_a_fixed_half_life_loses_them():
    """The same rounds with the learned survival switched off (the 60 s half-life only): returns lose pages,
    so the test above measures what the learned gaps change."""
    never = LogGapFit(min_samples=10**9)
    assert sum(_lost_returns(ValuePerByte(gaps=never))) > 0


def test_survival_orders_idle_pages_and_falls_back_to_the_prior():
    p = ValuePerByte(half_life_s=60.0)
    assert p.survival(60.0) == 0.5  # no gaps seen: the prior
    for _ in range(40):
        p.observe_gap(2.0)
    assert p.survival(0.5) > 0.9 and p.survival(120.0) < 1e-6
    assert p.survival(120.0) > p.survival(240.0) > 0  # dead pages still ordered least recently used first
