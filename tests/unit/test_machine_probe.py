"""The machine-speed probe recorded beside benchmark numbers (bench/machine.py) and where reports print it."""

from __future__ import annotations

import math

import torch

from bench.machine import probe, render_samples, steal_seconds


def test_probe_measures_both_rates_and_restores_the_thread_setting():
    before = torch.get_num_threads()
    s = probe(threads=1, timings=2, read_mb=32)
    assert s["threads"] == 1  # ran with the threads asked for ...
    assert torch.get_num_threads() == before  # ... and gave the process its setting back
    for key in ("gemm_gflops", "read_gb_s"):
        assert math.isfinite(s[key]) and s[key] > 0, s
    # a 256x576x1536 bf16 multiply on one core cannot run at under 1 GFLOP/s nor read at under 0.1 GB/s on any CPU
    # this project supports; much slower means the timing measured something else (the allocation, the first call)
    assert s["gemm_gflops"] > 1 and s["read_gb_s"] > 0.1, s
    assert s["loadavg"] is None or len(s["loadavg"]) == 3


def test_steal_is_read_from_the_cpu_line(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 9000 3 0 2 250 0 0\ncpu0 50 0 25 4500 1 0 1 125 0 0\n")
    assert steal_seconds(stat) == 2.5
    assert steal_seconds(tmp_path / "missing") is None
    (tmp_path / "short").write_text("cpu 1 2 3\n")
    assert steal_seconds(tmp_path / "short") is None


def test_render_gives_each_repetition_and_the_spread_or_says_it_was_not_probed():
    samples = [{"gemm_gflops": 300.0, "read_gb_s": 20.0, "loadavg": [1.0, 1.0, 1.0], "steal_s": 10.0},
               {"gemm_gflops": 360.0, "read_gb_s": 30.0, "loadavg": [2.5, 1.0, 1.0], "steal_s": 13.5}]
    line = render_samples(samples)
    assert "300 / 360 GFLOP/s (spread 1.20x)" in line
    assert "20.0 / 30.0 GB/s (spread 1.50x)" in line
    assert "load 1m 1.00 / 2.50" in line and "stolen by the host during the sitting 3.5 s" in line
    assert "not probed" in render_samples([{}, {}]) and "not probed" in render_samples([])


def test_peer_and_matrix_reports_print_the_samples():
    from bench.peer import render
    from bench.report import _machine_cell, _range_cell

    r = {"talaria": {"model": "m", "url": "u", "config": None}, "peer": {"model": "m", "url": "p"}, "repeats": 1,
         "rows": [{"metric": "chat_sct_p50_s", "talaria": 1.0, "peer": 2.0, "talaria_advantage": 2.0}],
         "identical_completions": 1.0, "machine": [{"gemm_gflops": 355.0, "read_gb_s": 31.0, "loadavg": [0.5, 0, 0], "steal_s": 1.0}]}
    assert "bf16 GEMM 355 GFLOP/s" in render(r)
    assert _machine_cell({"machine": {"gemm_gflops": 355.4, "read_gb_s": 31.04}}) == "355, 31.0"
    assert _machine_cell({"machine": {}}) == "n/a" and _machine_cell({}) == "n/a"
    assert _range_cell({"min": 300.0, "max": 355.0}, 0) == "300-355" and _range_cell(None, 0) == "n/a"
    assert _range_cell({"min": 0.845, "max": 2.5}, 2) == "0.84-2.50" and _range_cell({}, 1) == "n/a"


def test_peer_rows_pair_each_repetition_and_orient_the_advantage():
    from bench.peer import compare_runs

    runs = {"talaria": [{"chat_sct_p50_s": 33.2, "decode_8_tok_s": 351.0}, {"chat_sct_p50_s": 30.0, "decode_8_tok_s": 393.0},
                        {"chat_sct_p50_s": 29.0, "decode_8_tok_s": 378.0}],
            "peer": [{"chat_sct_p50_s": 42.4, "decode_8_tok_s": 230.0}, {"chat_sct_p50_s": 39.7, "decode_8_tok_s": 400.0},
                     {"chat_sct_p50_s": 38.7, "decode_8_tok_s": 270.0}]}
    rows = {r["metric"]: r for r in compare_runs(runs)}
    sct = rows["chat_sct_p50_s"]
    assert sct["talaria"] == 30.0 and sct["peer"] == 39.7 and abs(sct["talaria_advantage"] - 39.7 / 30.0) < 1e-12
    # per repetition 42.4/33.2 = 1.277, 39.7/30.0 = 1.323, 38.7/29.0 = 1.334: the median pairs repetition 2 with itself
    assert abs(sct["paired"]["median"] - 39.7 / 30.0) < 1e-12 and abs(sct["paired"]["min"] - 42.4 / 33.2) < 1e-12
    assert sct["paired"]["won"] == 3 and sct["paired"]["n"] == 3
    dec = rows["decode_8_tok_s"]  # a rate: Talaria / peer, and repetition 2 lost (393 < 400)
    assert abs(dec["paired"]["min"] - 393.0 / 400.0) < 1e-12 and dec["paired"]["won"] == 2
