"""``dlshare bench sched``: every policy on the evaluation traces, in one run.

Default: philly/vc_0e4a51 on 16x4 GPUs and synergy/static_100job on Synergy's
cluster (4 servers of 8 GPUs, 24 cores, 500 GB), plus philly/vc_103959 as the
held-out check that ``dlshare`` is not fitted to the first two.  vc_103959 runs
on 4x4 GPUs: it offers 12.4 GPUs of work on average, so on 64 GPUs (load 0.19)
no policy matters; on 16 its load (0.78) is like vc_0e4a51's on 64 (0.67).
Every run reports the mean, median and p99 JCT, the p99 and worst slowdown
(JCT over the job's isolated duration) and the preemptions per job, simulated with a restart cost
per resume (scheduler.sim.RESTART_COST_S, 30 s; ``--restart-cost``).  Also:

* the co-location predictor's grouped-by-pair CV on Lucid's runs
  (``interference_mape_cv``) beside the constant, a plain random forest on the
  same profiles and the collaborative-filtering hybrid;
* what prediction costs: ``dlshare`` with the predictors a live system has
  against an oracle that knows every pair's true speeds;
* ``tuner``: the batch-size tuner replayed on Lucid's batch-size variants
  (bench/tuner.py);
* ``shapes``: every policy on seeded synthetic traces of other shapes (bench/shapes.py: other
  kinds of workload, and the shapes of the held-out Philly VCs), with issue 23's targets on each
  (bench/sched_shapes.py), the check that no knob was fitted to the shared traces;
* ``mixed``: vc_0e4a51 on one third each of V100, P100 and K80 servers, ``dlshare`` (which places by
  GPU generation) against the generation-blind policies: ``mixed_vs_blind`` (bench/sched_mixed.py);
* ``memshort``: static_100job on a memory-short Synergy cluster (250 GB servers) with two
  data-preparation donors, local only against lent memory, a donor reclaim, and the 500 GB bound
  (bench/sched_memory.py);
* ``fairshare``: one synthetic user floods the queue (30% of a Philly VC's jobs, in bursts): the
  other users' mean JCT with fair share between users against without, the flooder's and every
  job's (bench/sched_fairshare.py); also with 2D-LAS and FIFO inside and on the synthetic shapes;
* the p99 latency of one placement decision on a 1,000-node cluster (dlshare
  against FIFO), and the fidelity check of our FIFO against published
  simulators (203-225 h).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from bench import report

POLICIES = ["fifo", "spread", "srtf", "las", "tiresias", "gittins", "gittins-known", "gandiva", "horus", "iadeep",
            "synergy", "dlshare"]
REFERENCES = ("srtf", "gittins-known")  # told durations or their law: never counted as a baseline
DEFAULT_RUNS = [("vc_0e4a51", "16x4"), ("static_100job", "4x8:24:500"), ("vc_103959", "4x4")]
# Published results on the same inputs (shared/data/README.md): FIFO 203-225 h, LAS 138-156 h,
# 2D-Gittins 127 h, GPU utilisation 0.654 on vc_0e4a51 / 64 GPUs; SRTF-Tune 4.11 h on static_100job.
FIFO_RANGE_H = (203.0, 225.0)
BEST_PEER_0E4A51_H = 127.0
PEER_GPU_UTIL = 0.654
SRTF_TUNE_H = 4.11


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--trace", {"help": "sched: a trace (path or name) instead of the defaults"}),
                     ("--cluster", {"help": "sched: NODESxGPUS[:CORES:MEMGB] for --trace"}),
                     ("--policies", {"help": "sched: comma-separated profiles (default: all)"}),
                     ("--seed", {"type": int, "default": 0, "help": "sched: simulation seed"}),
                     ("--restart-cost", {"type": float, "default": None, "metavar": "S",
                                         "help": "sched: GPU seconds each resume costs (default: the simulator's, 30)"}),
                     ("--latency-nodes", {"type": int, "default": 1000,
                                          "help": "sched: cluster size for the decision-latency probe"})):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def decision_latency(profile: str, nodes: int = 1000, gpus: int = 8, decisions: int = 400,
                     seed: int = 0) -> dict[str, float]:
    """p50/p99 milliseconds of ``handle(JobArrived)`` that places one job, on a
    cluster kept ~75% busy with a Philly-like mix of job sizes."""
    from scheduler import Job, JobArrived, JobFinished, Node, SchedulerState, load_profile
    from scheduler.events import Place
    from scheduler.predictors import Predictors
    from scheduler.predictors.sensitivity import SensitivityModel

    rng = random.Random(seed)
    st = SchedulerState(load_profile(profile), [Node(f"n{i}", gpus, 3 * gpus, int(62.5e9 * gpus)) for i in range(nodes)],
                        predictors=Predictors(sensitivity=SensitivityModel.from_data()), rng=random.Random(seed))
    models = ["ResNet-18@32", "Transformer@128", "LM@20", "ResNet-50@64", "Recommendation@2048"]
    sizes = [1, 1, 1, 1, 2, 4, 8]
    running: list[str] = []
    now = 0.0
    k = 0

    def submit() -> float:
        nonlocal k, now
        k += 1
        now += 1.0
        m, bs = rng.choice(models).split("@")
        job = Job(f"j{k}", m, int(bs), gpus=rng.choice(sizes), arrival=now)
        c0, t0 = time.thread_time(), time.perf_counter()
        out = st.handle(JobArrived(f"e{k}", now, job))
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if any(isinstance(d, Place) for d in out):
            running.append(job.id)
        return dt, dc

    target = int(0.75 * nodes * gpus)
    while st.total_gpus - st.free_gpus < target:
        submit()
    wall, cpu = [], []
    for _ in range(decisions):
        while running and st.total_gpus - st.free_gpus >= target:
            victim = running.pop(rng.randrange(len(running)))
            now += 1.0
            st.handle(JobFinished(f"f{victim}", now, victim))
        w, c = submit()
        wall.append(w)
        cpu.append(c)
    ms, cms = np.asarray(wall) * 1000.0, np.asarray(cpu) * 1000.0
    # Wall time includes the moments the OS ran someone else (this machine is shared);
    # the thread's CPU time is the decision's own cost.
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "cpu_p50_ms": float(np.percentile(cms, 50)), "cpu_p99_ms": float(np.percentile(cms, 99))}


def _plot(runs: list[dict[str, Any]], jcts: dict[tuple[str, str], np.ndarray], out_dir) -> list[str]:
    plt = report.pyplot()
    files = []
    for trace in sorted({r["trace"] for r in runs}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        mine = [r for r in runs if r["trace"] == trace]
        colours = plt.get_cmap("tab20").colors
        for i, r in enumerate(mine):
            v = np.sort(jcts[(trace, r["policy"])] / 3600.0)
            ours = r["policy"] == "dlshare"
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r["policy"], linewidth=2.4 if ours else 1.0,
                    color="black" if ours else colours[(2 * i) % 20])
        ax.set_xscale("log")
        ax.set_xlabel("job completion time (h)")
        ax.set_ylabel("fraction of jobs")
        ax.set_title(f"JCT CDF: {trace}, cluster {mine[0]['cluster']}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        p = out_dir / f"sched_jct_cdf_{trace}.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        files.append(str(p))
    return files


def run(args) -> dict[str, Any]:
    from scheduler import data
    from bench import sched_shapes
    from bench.tuner import evaluate as tuner_eval
    from scheduler.predictors.colocation import cross_validate as colocation_cv
    from scheduler.predictors.colocation import lucid_pairs
    from scheduler.predictors.interference import cross_validate, rows_to_sets
    from scheduler.sim import RESTART_COST_S, Cluster, simulate
    from scheduler.trace import load_trace

    quick = getattr(args, "quick", False)
    if getattr(args, "trace", None):
        pairs = [(args.trace, getattr(args, "cluster", None) or "16x4")]
    else:
        pairs = DEFAULT_RUNS
    policies = (args.policies.split(",") if getattr(args, "policies", None)
                else POLICIES)
    seed = getattr(args, "seed", 0) or 0
    restart = getattr(args, "restart_cost", None)
    if restart is None:
        restart = RESTART_COST_S
    runs: list[dict[str, Any]] = []
    jcts: dict[tuple[str, str], np.ndarray] = {}
    for trace_arg, cluster_s in pairs:
        trace_path = data.resolve_trace(trace_arg)
        trace_name = trace_path.stem
        trace = load_trace(trace_path)
        cluster = Cluster.parse(cluster_s)
        pols = policies
        if quick and trace_name.startswith("vc_"):
            pols = [p for p in policies if p in ("fifo", "gittins", "dlshare")]
            if trace_name == "vc_103959":
                pols = [p for p in pols if p in ("fifo", "dlshare")]
        for pol in pols:
            r = simulate(trace, cluster, sched_shapes.run_profile(pol, trace, pol), seed=seed, trace_name=trace_name,
                         restart_overhead_s=restart)
            m = r.metrics()
            m["cluster"] = cluster_s
            runs.append(m)
            jcts[(trace_name, pol)] = r.jct_s
            print(f"  {trace_name:14s} {pol:9s} avg JCT {m['avg_jct_h']:8.2f} h  p99 {m['p99_jct_h']:8.2f} h  "
                  f"worst slowdown {m['worst_slowdown'] or 0:8.1f}  preemptions/job {m['preemptions_per_job']:.2f}  "
                  f"({m['sim_wall_s']:.1f} s)", flush=True)

    from bench.sched_memory import checks as memshort_checks
    from bench.sched_memory import memshort

    mem = memshort(seed) if not getattr(args, "trace", None) else {"metrics": {}, "rows": []}
    from bench import sched_fairshare

    if getattr(args, "trace", None):  # the given trace on its cluster, with dlshare only
        path = data.resolve_trace(args.trace)
        fs = sched_fairshare.flood(seed, quick, trace=load_trace(path), cluster=pairs[0][1], trace_name=path.stem,
                                   shapes=(), inner=())
    else:
        fs = sched_fairshare.flood(seed, quick)
    cost = predictor_cost(pairs, quick, seed, restart)
    pairs_l, speeds_l, groups_l = lucid_pairs()
    cv = colocation_cv(pairs_l, speeds_l, groups_l, seeds=(0,) if quick else (0, 1, 2), hybrid=not quick)
    models, X, y = data.colocation_util()
    cv_iadeep = cross_validate(rows_to_sets(models, X), y, repeats=1)
    tuner = tuner_eval(rounds=15, seeds=(0,) if quick else (0, 1, 2))
    shapes = sched_shapes.run_shapes(quick, seed, restart) if not getattr(args, "trace", None) else []
    from bench import sched_mixed

    mix = (sched_mixed.mixed(quick, seed, restart) if not getattr(args, "trace", None)
           else {"rows": [], "metrics": {}})
    n_lat = getattr(args, "latency_nodes", None) or 1000
    lat = decision_latency("dlshare", nodes=n_lat, decisions=150 if quick else 400)
    lat_fifo = decision_latency("fifo", nodes=n_lat, decisions=150 if quick else 400)

    def get(trace: str, pol: str, key: str) -> float | None:
        for r in runs:
            if r["trace"] == trace and r["policy"] == pol:
                return r[key]
        return None

    fifo = get("vc_0e4a51", "fifo", "avg_jct_h")
    baselines = [r["avg_jct_h"] for r in runs
                 if r["trace"] == "vc_0e4a51" and r["policy"] not in ("dlshare", *REFERENCES)]
    best_baseline = min(baselines) if baselines else None
    dl = get("vc_0e4a51", "dlshare", "avg_jct_h")
    metrics = {
        "interference_mape_cv": cv["gbrt_mape"], "interference_mae_cv": cv["gbrt_mae"],
        "interference_mape_cv_range": cv["gbrt_mape_range"],
        "interference_constant_mape_cv": cv["constant_mape"], "interference_forest_mape_cv": cv["forest_mape"],
        "interference_hybrid_mape_cv": cv.get("hybrid_mape"),
        "interference_cv": "lucid, per-job speed, grouped by model pair, "
                           f"{cv['folds']} folds x {len(cv['seeds'])} dealings",
        "iadeep_mape_cv": cv_iadeep["mape"], "iadeep_naive_mape_cv": cv_iadeep["naive_mape"],
        **{f"predictor_cost_{t}": c["ratio"] for t, c in cost.items()},
        "tuner_gain_vs_default": tuner["gain_vs_default"], "tuner_of_best": tuner["of_best"],
        "tuner_regret": tuner["regret"], "tuner_regret_default": tuner["regret_default"],
        "decision_p99_ms_1000_nodes": lat["p99_ms"], "decision_p50_ms_1000_nodes": lat["p50_ms"],
        "decision_cpu_p99_ms_1000_nodes": lat["cpu_p99_ms"],
        "decision_p99_ms_1000_nodes_fifo": lat_fifo["p99_ms"], "decision_cpu_p99_ms_1000_nodes_fifo": lat_fifo["cpu_p99_ms"],
        "decision_latency_nodes": n_lat, "restart_cost_s": restart,
        "fidelity_fifo_avg_jct_h": fifo,
        "fidelity_fifo_in_range": (fifo is not None and FIFO_RANGE_H[0] * 0.95 <= fifo <= FIFO_RANGE_H[1] * 1.05),
        "dlshare_vs_best_peer": (dl / BEST_PEER_0E4A51_H) if dl else None,
        "dlshare_vs_best_baseline": (dl / best_baseline) if dl and best_baseline else None,
        **mem["metrics"],
        **fs["metrics"],
        **mix["metrics"],
    }
    checks = [
        ("FIFO avg JCT vc_0e4a51 (h) >= 203*0.95", fifo, ">=", FIFO_RANGE_H[0] * 0.95),
        ("FIFO avg JCT vc_0e4a51 (h) <= 225*1.05", fifo, "<=", FIFO_RANGE_H[1] * 1.05),
        ("dlshare avg JCT vc_0e4a51 (h)", dl, "<=", 100.0),
        ("dlshare avg JCT vc_0e4a51 vs 0.8 x best peer (127 h)", dl, "<=", 0.8 * BEST_PEER_0E4A51_H),
        ("dlshare avg JCT vs best baseline", dl, "<=", best_baseline),
        ("dlshare p99 JCT vs FIFO p99 (h)", get("vc_0e4a51", "dlshare", "p99_jct_h"), "<=",
         get("vc_0e4a51", "fifo", "p99_jct_h")),
        ("dlshare GPU utilisation vc_0e4a51", get("vc_0e4a51", "dlshare", "gpu_util"), ">=", PEER_GPU_UTIL),
        ("dlshare avg JCT static_100job (h)", get("static_100job", "dlshare", "avg_jct_h"), "<=", SRTF_TUNE_H),
        ("dlshare avg JCT vc_103959 vs best baseline", get("vc_103959", "dlshare", "avg_jct_h"), "<=",
         min([r["avg_jct_h"] for r in runs
              if r["trace"] == "vc_103959" and r["policy"] not in ("dlshare", *REFERENCES)], default=None)),
        ("dlshare p99 JCT vc_103959 vs FIFO p99 (h)", get("vc_103959", "dlshare", "p99_jct_h"), "<=",
         get("vc_103959", "fifo", "p99_jct_h")),
        ("interference_mape_cv (Lucid, grouped by pair)", cv["gbrt_mape"], "<=", 0.05),
        ("interference_mape_cv vs the constant", cv["gbrt_mape"], "<=", cv["constant_mape"]),
        ("interference_mape_cv vs a plain random forest", cv["gbrt_mape"], "<=", cv["forest_mape"]),
        *sched_shapes.checks(runs),
        *sched_shapes.checks(shapes),
        *(sched_mixed.checks(mix["metrics"]) if mix["metrics"] else []),
        ("decision_p99_ms_1000_nodes (wall)", lat["p99_ms"], "<=", 10.0),
        ("decision p99 on 1000 nodes, thread CPU time (ms)", lat["cpu_p99_ms"], "<=", 10.0),
        *(memshort_checks(mem["metrics"]) if mem["metrics"] else []),
        *sched_fairshare.checks(fs["metrics"], fs["rows"]),
    ]
    targets = report.target_rows(checks)
    cols = ["trace", "cluster", "policy", "avg_jct_h", "median_jct_h", "p99_jct_h", "p99_slowdown", "worst_slowdown",
            "makespan_h", "avg_queueing_h", "gpu_util", "cpu_util", "mem_util", "preemptions", "preemptions_per_job", "sim_wall_s"]
    print(report.markdown_table(runs, cols))
    print(report.markdown_table([{"metric": k, "value": v} for k, v in metrics.items()]))
    if shapes:
        print(report.markdown_table(sched_shapes.table(shapes)))
    if mix["rows"]:
        print(report.markdown_table(mix["rows"]))
    if mem["rows"]:
        print(report.markdown_table(mem["rows"]))
    fs_rows = sched_fairshare.table(fs["rows"])
    print(report.markdown_table(fs_rows))
    print(report.markdown_table(targets))
    out = report.out_dir(getattr(args, "json", None))
    plots = _plot(runs, jcts, out) + sched_fairshare.plot(fs["rows"], fs["jcts"], out)
    slim = [{k: r[k] for k in ("trace", "cluster", "policy", "avg_jct_h", "median_jct_h", "p99_jct_h", "p99_slowdown",
                               "worst_slowdown", "makespan_h", "gpu_util", "sim_wall_s", "avg_queueing_h", "cpu_util",
                               "mem_util", "preemptions", "preemptions_per_job")}
            for r in runs]
    return report.envelope("sched", metrics, runs=slim, targets=targets, plots=plots, quick=quick,
                           interference_cv=cv, iadeep_cv=cv_iadeep, predictor_cost=cost, tuner=tuner, shapes=shapes, mixed=mix["rows"],
                           decision_latency={"dlshare": lat, "fifo": lat_fifo}, memshort=mem["rows"],
                           fairshare=fs_rows)


def predictor_cost(pairs: list[tuple[str, str]], quick: bool, seed: int,
                   restart: float | None = None) -> dict[str, dict[str, float]]:
    """``dlshare`` with what a live system knows (the co-location predictor on solo
    telemetry, plus pairs measured during the run) against an oracle that knows
    every pair's true speed from the start, on the Philly traces."""
    from scheduler import data
    from scheduler.sim import Cluster, simulate
    from scheduler.trace import load_trace

    out = {}
    for trace_arg, cluster_s in pairs:
        path = data.resolve_trace(trace_arg)
        if not path.stem.startswith("vc_") or (quick and path.stem != "vc_103959"):
            continue
        trace, cl = load_trace(path), Cluster.parse(cluster_s)
        kw = {} if restart is None else {"restart_overhead_s": restart}
        live = simulate(trace, cl, "dlshare", seed=seed, **kw).metrics()["avg_jct_h"]
        oracle = simulate(trace, cl, "dlshare", seed=seed, predictors="oracle", **kw).metrics()["avg_jct_h"]
        out[path.stem] = {"live_avg_jct_h": live, "oracle_avg_jct_h": oracle, "ratio": live / oracle}
        print(f"  {path.stem:14s} dlshare live {live:.2f} h, oracle {oracle:.2f} h", flush=True)
    return out
