"""bench/forecast.py on a small slice of a Philly trace: every job that waited gets an estimate
from the replay, the oracle (true run times) is never further off than the prior's guess, and the
report carries what RESULTS.md quotes."""

from __future__ import annotations

import argparse

from bench import forecast
from scheduler import data
from scheduler.sim import Cluster
from scheduler.trace import load_trace


def test_the_estimates_are_measured_against_the_real_starts():
    trace = sorted(load_trace(data.resolve_trace("vc_103959")), key=lambda j: j.arrival_s)[:80]
    m = forecast.measure(trace, Cluster.parse("4x4"), "fifo")
    assert m["waited"] >= 10 and m["forecasts"] >= m["waited"] // 2
    for est in ("replay", "work_ahead", "oracle"):
        r = m[est]
        assert 0 <= r["within_25"] <= r["within_50"] <= 1 and r["median_error"] >= 0, (est, r)
    assert m["replay"]["estimated"] == 1.0  # every waiting job got a start within the horizon
    assert m["oracle"]["within_25"] >= m["replay"]["within_25"]  # knowing run times can only help
    assert len(m["_points"]) == m["waited"] and m["forecast_ms_mean"] > 0


def test_the_bench_runs_from_the_command_line_options(tmp_path):
    args = argparse.Namespace(quick=True, json=str(tmp_path / "f.json"), forecast_trace="vc_103959",
                              forecast_cluster="4x4", forecast_profiles="fifo", forecast_jobs=40)
    res = forecast.run(args)
    assert res["bench"] == "forecast" and {r["estimate"] for r in res["rows"]} == {"replay", "work_ahead", "oracle"}
    assert (tmp_path / "forecast.png").stat().st_size > 10_000
