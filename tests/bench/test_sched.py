"""bench/sched.py end to end on a small trace: the JSON shape the issue asks for, plots, targets."""

import argparse
import math
from pathlib import Path

import pytest

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
    assert any(p.endswith("sched_fairshare.png") for p in res["plots"])
    assert m["fairshare_trace"] == "t" and m["fairshare_others_vs_none"] > 0 and m["fairshare_total_vs_none"] > 0
    assert [r["policy"] for r in res["fairshare"]] == ["dlshare"]
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


def test_flood_trace_gives_the_flooder_its_share_in_bursts_and_keeps_every_job():
    from bench.sched_fairshare import FLOODER, flood_trace
    from bench.shapes import SHAPES, make_trace

    base = make_trace(SHAPES[0], seed=1)
    owned = flood_trace(base, seed=0)
    assert sorted(t.id for t in owned) == sorted(t.id for t in base)
    mine = [t for t in owned if t.user == FLOODER]
    assert len(mine) == round(0.3 * len(base)) and len({t.user for t in owned}) == 10
    starts = sorted(t.arrival_s for t in mine)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert sum(g > 600.0 for g in gaps) <= round(len(mine) / 25)  # bursts of ~25, each within 10 minutes
    same = {t.id: t for t in base}
    assert all((t.model, t.gpus, t.duration_s) == (same[t.id].model, same[t.id].gpus, same[t.id].duration_s)
               for t in owned)
    assert flood_trace(base, seed=0) == owned and flood_trace(base, seed=1) != owned


def test_flood_benchmark_small_run_reports_sane_metrics(tmp_path):
    from bench import sched_fairshare
    from bench.shapes import SHAPES, make_trace

    trace = make_trace(SHAPES[5], seed=1)[:120]  # "small": 2x4 GPUs
    # tiresias and fifo: the same code path as dlshare, without training the co-location predictor
    res = sched_fairshare.flood(trace=trace, cluster="2x4", trace_name="small120", shapes=(), inner=("fifo",),
                                profile="tiresias")
    m = res["metrics"]
    for key in ("fairshare_others_vs_none", "fairshare_flood_vs_none", "fairshare_total_vs_none",
                "fairshare_others_bound"):
        assert isinstance(m[key], float) and 0 < m[key] < 20, key
    main = res["rows"][0]
    assert main["flood_jobs"] == 36 and main["fs_failed"] == main["none_failed"] == 0
    assert m["fairshare_others_vs_none"] == main["fs_others_h"] / main["none_others_h"]
    # the others alone are the floor: never slower than beside the flood
    assert main["alone_others_h"] <= main["none_others_h"] * 1.05
    total = (main["fs_others_h"] * (120 - 36) + main["fs_flood_h"] * 36) / 120
    assert total == pytest.approx(main["fs_total_h"])
    assert [r["policy"] for r in res["rows"]] == ["tiresias", "fifo"]
    checks = sched_fairshare.checks(m, res["rows"])
    assert len(checks) == 3 and all(c[1] is not None for c in checks)
    assert Path(sched_fairshare.plot(res["rows"], res["jcts"], tmp_path)[0]).stat().st_size > 0


def test_shape_targets_follow_the_issue_bounds():
    from bench import sched_shapes

    rows = [{"trace": "x", "cluster": "2x4", "policy": p, "avg_jct_h": m, "p99_jct_h": p99, "worst_slowdown": w,
             "preemptions_per_job": pre}
            for p, m, p99, w, pre in (("fifo", 10.0, 50.0, 400.0, 0.0), ("las", 8.0, 70.0, 9.0, 5.0),
                                      ("tiresias", 7.5, 60.0, 8.0, 2.0), ("gittins", 7.0, 65.0, 7.0, 1.5),
                                      ("srtf", 4.0, 55.0, 2.0, 0.4), ("dlshare", 5.5, 54.0, 30.0, 1.2))]
    b = sched_shapes.bounds(rows, "x")
    assert b["mean"] == pytest.approx(max(0.8 * 7.0, 1.1 * 4.0)) and b["p99"] == pytest.approx(55.0)
    assert b["worst_slowdown"] == pytest.approx(40.0)
    met = {name.split(" x")[0]: v <= bound for name, v, _, bound in sched_shapes.checks(rows)}
    assert list(met.values()) == [True, True, True, False]  # mean, p99, worst slowdown; 1.2 preemptions a job
    table = sched_shapes.table(rows)
    assert table[0]["dlshare"] == "5.5 / 54 / 30 / 1.20"


def test_shapes_on_many_seeds_count_targets_per_seed_and_compare_two_profiles():
    from bench import sched_shapes

    def rows(seed, ours):  # ours: (mean, p99, worst slowdown, preemptions) of dlshare
        base = (("fifo", 10.0, 50.0, 400.0, 0.0), ("las", 8.0, 70.0, 9.0, 5.0), ("tiresias", 7.5, 60.0, 8.0, 2.0),
                ("gittins", 7.0, 65.0, 7.0, 1.5), ("srtf", 4.0, 55.0, 2.0, 0.4), ("dlshare", *ours))
        return [{"trace": "x", "cluster": "2x4", "seed": seed, "policy": p, "avg_jct_h": m, "p99_jct_h": p99,
                 "worst_slowdown": w, "preemptions_per_job": pre} for p, m, p99, w, pre in base]

    a = rows(0, (5.5, 54.0, 30.0, 1.2)) + rows(1, (6.0, 60.0, 50.0, 0.5))  # seed 1: mean, p99, worst missed
    met = sched_shapes.met_per_seed(a)
    assert met[0] == {"mean": (1, 1), "p99": (1, 1), "worst slowdown": (1, 1), "preemptions": (0, 1)}
    assert met[1] == {"mean": (0, 1), "p99": (0, 1), "worst slowdown": (0, 1), "preemptions": (1, 1)}
    b = rows(0, (11.0, 54.0, 30.0, 0.6)) + rows(1, (6.0, 60.0, 50.0, 0.5))
    c = sched_shapes.compare(a, b)
    assert c["avg_jct_h"]["geomean"] == pytest.approx(math.sqrt(0.5)) and c["avg_jct_h"]["better"] == 1
    assert c["avg_jct_h"]["worse"] == 0 and c["preemptions_per_job"]["worse"] == 1
    assert c["p99_jct_h"]["geomean"] == pytest.approx(1.0) and c["p99_jct_h"]["cases"] == 2


def test_mean_misses_are_counted_against_the_known_distribution_reference():
    from bench import sched_shapes

    def rows(trace, ours, known):
        base = (("fifo", 10.0), ("las", 8.0), ("tiresias", 7.5), ("gittins", 7.0), ("srtf", 4.0),
                ("dlshare", ours), (sched_shapes.KNOWN, known))
        return [{"trace": trace, "cluster": "2x4", "seed": 0, "policy": p, "avg_jct_h": m, "p99_jct_h": 50.0,
                 "worst_slowdown": 9.0, "preemptions_per_job": 0.1} for p, m in base]

    # bound 5.6 on each: "a" met; "b" missed by both; "c" missed by dlshare only
    r = rows("a", 5.5, 5.0) + rows("b", 6.5, 6.0) + rows("c", 6.5, 5.0)
    assert sched_shapes.out_of_reach(r) == {0: (2, 1)}
    assert sched_shapes.bounds(r, "b")["best_agnostic"] == 7.0  # the reference is not a baseline


def test_the_known_distribution_reference_is_gittins_told_the_traces_run_times():
    from bench import sched_shapes
    from bench.shapes import ALL_SHAPES, make_trace

    shape = next(s for s in ALL_SHAPES if s.name == "gang-small")
    trace = make_trace(shape, seed=1)
    prof = sched_shapes.known_profile(trace)
    assert prof.order.plugin == "gittins" and prof.order.args["learn"] is False
    assert sorted(prof.order.args["samples"]) == sorted(j.duration_s for j in trace)
    rows = sched_shapes.run_shapes(False, 0, 30.0, policies=("gittins", sched_shapes.KNOWN), shapes=("gang-small",))
    assert [r["policy"] for r in rows] == ["gittins", sched_shapes.KNOWN]
    assert rows[0]["avg_jct_h"] != rows[1]["avg_jct_h"]  # the Philly prior ranks these hours-long jobs otherwise


def test_shapes_on_many_seeds_run_as_the_benchmark_runs_them():
    """run_cases gives, seed by seed, the rows the benchmark's own shapes part gives, in processes too."""
    from bench import sched_shapes

    one = sched_shapes.run_cases((0, 1), 30.0, policies=("fifo", "srtf"), shapes=("gang-small",))
    assert [(r["seed"], r["policy"]) for r in one] == [(0, "fifo"), (0, "srtf"), (1, "fifo"), (1, "srtf")]
    same = sched_shapes.run_shapes(False, 0, 30.0, policies=("fifo", "srtf"), shapes=("gang-small",))
    assert [r["avg_jct_h"] for r in one[:2]] == [r["avg_jct_h"] for r in same]
    assert one[2]["avg_jct_h"] != one[0]["avg_jct_h"]  # another seed, another trace
    two = sched_shapes.run_cases((0, 1), 30.0, policies=("fifo", "srtf"), shapes=("gang-small",), workers=2)
    assert [r["avg_jct_h"] for r in two] == [r["avg_jct_h"] for r in one]


def test_mixed_cluster_benchmark_runs_blind_and_typed_dlshare():
    from bench import sched_mixed
    from scheduler.trace import TraceJob

    trace = [TraceJob(str(i), 900.0 * i, m, b, g, 0, 3600.0 * (1 + i % 3))
             for i, (m, b, g) in enumerate([("ResNet-18", 32, 1), ("Recommendation", 2048, 1), ("ResNet-50", 64, 2),
                                            ("Transformer", 128, 1)] * 6)]
    res = sched_mixed.mixed(True, 0, 30.0, cluster="1x4@v100,1x4@k80", trace=trace, trace_name="t")
    assert [r["policy"] for r in res["rows"]] == ["fifo", "gittins", "dlshare-blind", "dlshare"]
    m = res["metrics"]
    assert m["mixed_vs_blind"] == pytest.approx(m["mixed_dlshare_jct_h"] / m["mixed_best_blind_jct_h"])
    assert m["mixed_vs_blind"] < 1.0  # placing by generation beats the same policy blind to it here
    assert sched_mixed.checks(m)[0][1] == m["mixed_vs_blind"]
