"""bench/sched.py end to end on a small trace: the JSON shape the issue asks for, plots, targets."""

import argparse
from pathlib import Path

from bench import sched


def test_bench_sched_small_run(tmp_path):
    trace = tmp_path / "t.csv"
    rows = ["job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s"]
    rows += [f"{i},{i * 300.0},ResNet-18,32,{1 + (i % 3 == 0)},100,{3600.0 * (1 + i % 5)}" for i in range(30)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "sched.json"
    args = argparse.Namespace(quick=True, json=str(out), trace=str(trace), cluster="2x2", policies="fifo,dlshare",
                              seed=0, latency_nodes=30)
    res = sched.run(args)
    assert res["bench"] == "sched"
    assert [r["policy"] for r in res["runs"]] == ["fifo", "dlshare"]
    for r in res["runs"]:
        assert set(r) >= {"trace", "cluster", "policy", "avg_jct_h", "median_jct_h", "p99_jct_h", "makespan_h",
                          "gpu_util", "sim_wall_s"}
        assert r["avg_jct_h"] > 0
    m = res["metrics"]
    assert 0 < m["interference_mape_cv"] < 5 and m["decision_p99_ms_1000_nodes"] > 0
    assert all(Path(p).exists() for p in res["plots"])
    assert any(t["met"] in ("yes", "MISSED", "n/a") for t in res["targets"])


def test_decision_latency_probe_places_jobs():
    lat = sched.decision_latency("fifo", nodes=20, gpus=4, decisions=30)
    assert 0 < lat["p50_ms"] <= lat["p99_ms"]


def test_memshort_reports_every_run_and_the_metrics_the_issue_names():
    from bench.sched_memory import checks, memshort

    res = memshort()
    m = res["metrics"]
    for key in ("memshort_local_jct_h", "memshort_lent_jct_h", "memshort_unconstrained_jct_h", "memshort_recovered",
                "memshort_reclaim_jct_h"):
        assert isinstance(m[key], float), key
    assert m["memshort_recovered"] == (m["memshort_local_jct_h"] - m["memshort_lent_jct_h"]) / (
        m["memshort_local_jct_h"] - m["memshort_unconstrained_jct_h"])
    assert m["memshort_unconstrained_jct_h"] <= m["memshort_lent_jct_h"] < m["memshort_local_jct_h"]
    assert m["memshort_lent_peak_gb"] > 0 and m["memshort_reclaim_early_taken_back_gb"] > 0
    assert len(res["rows"]) == 7 and all(r["failed"] == 0 for r in res["rows"])
    assert {c[0] for c in checks(m)} and all(c[1] is not None for c in checks(m))
