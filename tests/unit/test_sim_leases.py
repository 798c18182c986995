"""``talaria sim leases`` (issue 14 "Measure"): simulated hooks name the tool, the comparison's arithmetic."""

from __future__ import annotations

import math
import statistics

import pytest

from bench.stats import paired_ratio
from bench.workloads import Call, Session, Workload
from sim import leases, workload
from sim.cluster import Simulation
from sim.profile import load


def test_replay_tools_reach_the_hook_of_the_call_that_ran_them():
    """A replay call names the tool run *before* it; the simulator's call names the tool its answer invoked."""
    calls = [Call("s", 0, "m", 5, prompt_tokens=[3] * 10), Call("s", 1, "m", 5, 0.2, 10, append_tokens=[4] * 5, tool="grep"),
             Call("s", 2, "m", 5, 4.0, 20, append_tokens=[5] * 5, tool="pytest")]
    (s,) = workload.from_workload(Workload([Session("s", 0.0, calls)], {}))
    assert [c.tool for c in s.calls] == ["grep", "pytest", ""]


def test_simulated_router_learns_gaps_per_tool():
    prof = load("profiles/paper-tp4-router.yaml")
    sessions = leases.sessions_for("tools", 0, 4, 6, None, 4.0)
    tools = {c.tool for s in sessions for c in s.calls if c.tool}
    assert tools
    r = Simulation(leases.config(prof, "adaptive", 1.0), sessions).run()
    learned = {k.split("|")[1] for k in r.router["return_gaps"]}
    assert learned & tools and learned <= tools | {""}
    assert r.router["lease_policy"] == "adaptive"


def test_lease_configurations_of_the_comparison():
    prof = load("profiles/paper-tp4-router.yaml")
    none, decay, fixed = leases.config(prof, "none", 5.0), leases.config(prof, "adaptive-decay", 1.0), leases.config(prof, "fixed", 2.0)
    assert (none.name, none.tau_s) == ("no leases", 0.0)  # tau 0: the gateway installs no lease
    assert decay.params.lease_policy == "adaptive" and decay.params.lease_decay and not leases.config(prof, "adaptive", 1.0).params.lease_decay
    assert (fixed.name, fixed.tau_s, fixed.params.lease_policy) == ("fixed 2s", 2.0, "fixed")
    with pytest.raises(ValueError, match="unknown lease policy"):
        leases.config(prof, "sticky", 1.0)


def test_comparison_against_the_best_fixed_tau():
    row = lambda p50, p95, gib: {"sct_p50_s": p50, "sct_p95_s": p95, "lease_gib_s": gib}  # noqa: E731
    rows = {"adaptive": row(95.0, 200.0, 10.0), "fixed 1s": row(100.0, 190.0, 50.0), "fixed 5s": row(120.0, 180.0, 90.0)}
    c = leases.compare(rows)
    assert (c["best_fixed_p50"], c["best_fixed_p95"]) == ("fixed 1s", "fixed 5s")
    assert c["sct_p50_vs_best"] == pytest.approx(0.95) and c["sct_p95_vs_best"] == pytest.approx(200 / 180)
    assert c["kv_vs_best"] == pytest.approx(0.2) and c["goal_met"] is False  # p95 worse than the best fixed p95
    rows["adaptive"] = row(95.0, 170.0, 10.0)
    assert leases.compare(rows)["goal_met"] is True


def test_paired_ratios_compare_each_seed_with_the_same_seeds_best_fixed_run():
    """Seed-to-seed spread cancels in a paired ratio: per seed, the variant over the best fixed tau's run of
    that same seed (best chosen by the medians)."""
    row = lambda p50, p95, gib=1.0: {"sct_p50_s": p50, "sct_p95_s": p95, "lease_gib_s": gib}  # noqa: E731
    per_seed = {"adaptive-no-arith": [row(90, 200), row(190, 400), row(300, 500)],
                "fixed 1s": [row(100, 180), row(200, 420), row(310, 600)],
                "fixed 5s": [row(150, 170), row(250, 380), row(400, 450)]}
    rows = {n: {k: sorted(r[k] for r in rs)[1] for k in rs[0]} for n, rs in per_seed.items()}
    c = leases.compare(rows, "adaptive-no-arith", per_seed)
    assert (c["best_fixed_p50"], c["best_fixed_p95"]) == ("fixed 1s", "fixed 5s")
    p50, p95 = c["paired_sct_p50_vs_best"], c["paired_sct_p95_vs_best"]
    assert p50["median"] == pytest.approx(190 / 200) and (p50["wins"], p50["n"]) == (3, 3)
    assert (p95["median"], p95["min"], p95["max"]) == (pytest.approx(500 / 450), pytest.approx(400 / 380), pytest.approx(200 / 170))
    assert p95["wins"] == 0
    assert leases.compare(rows, "adaptive") == {}  # a variant that did not run


def test_paired_ratio_is_a_geometric_mean_with_a_student_t_interval():
    r = paired_ratio([110.0, 90.0, 121.0], [100.0, 100.0, 110.0])
    logs = [math.log(1.1), math.log(0.9), math.log(1.1)]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    assert r["ratio"] == pytest.approx(math.exp(mean))
    assert r["hi"] == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)))  # t(0.975, 2 df)
    assert r["lo"] == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)))
    assert (r["wins"], r["n"]) == (1, 3)
    assert paired_ratio([1.0], [2.0])["lo"] == 0.0  # one seed: no interval, nothing resolved


def test_goal_reads_the_paired_intervals_and_the_best_fixed_taus_memory():
    """Paired: "matches" = not measurably worse (each interval reaches 1), "beats" = both ratios <= 1; both
    need less GiB x s than the best-p50 fixed tau. A variant consistently 5 % slower fails however small its KV."""
    row = lambda p50, p95, gib: {"sct_p50_s": p50, "sct_p95_s": p95, "lease_gib_s": gib}  # noqa: E731
    fixed = {"fixed 1s": [row(100, 200, 50), row(200, 300, 50), row(300, 400, 50), row(150, 250, 50)],
             "fixed 5s": [row(120, 190, 90), row(230, 280, 90), row(330, 380, 90), row(170, 240, 90)]}

    def verdict(ad):
        per_seed = {"adaptive": ad, **fixed}
        rows = {n: leases.geomeans(rs) for n, rs in per_seed.items()}
        return leases.compare(rows, "adaptive", per_seed)

    noisy = [row(95, 195, 20), row(210, 270, 20), row(290, 390, 20), row(160, 245, 20)]  # p50 ~ fixed 1s, p95 ~ fixed 5s
    c = verdict(noisy)
    assert (c["best_fixed_p50"], c["best_fixed_p95"]) == ("fixed 1s", "fixed 5s")
    assert c["goal_met"] is True and c["paired_sct_p50_vs_best"]["lo"] < 1.0 < c["paired_sct_p50_vs_best"]["hi"]
    assert c["beats"] is False  # its p50 ratio is just above 1: matched, not beaten
    slower = [row(105, 210, 20), row(210, 316, 20), row(315, 420, 20), row(158, 262, 20)]  # 5 % worse on every seed
    c = verdict(slower)
    assert c["paired_sct_p50_vs_best"]["lo"] > 1.0 and c["goal_met"] is False
    c = verdict([row(90, 180, 60), row(180, 270, 60), row(270, 360, 60), row(135, 225, 60)])  # faster, but more KV than fixed 1s
    assert c["beats"] is False and c["goal_met"] is False
