"""``dlshare bench sched``, part ``shapes`` (issue 23): every policy on every synthetic shape.

The shapes are bench/shapes.py's: the seven kinds the tail bound was checked on (``SHAPES``) and the
shapes of the held-out Philly virtual clusters (``CLUSTER_SHAPES``: a 12-GPU cluster of mostly 8-GPU
jobs, 1-GPU floods, a 192-GPU fleet).  Every run is simulated with the restart cost
(scheduler.sim.RESTART_COST_S unless ``--restart-cost`` says otherwise) and reports, per policy, the
mean and p99 JCT, the worst slowdown and the preemptions per job.

The targets of issue 23 are checked on every shape and on the shared traces alike (:func:`checks`):

* mean JCT <= max(0.8 x the best of our duration-agnostic baselines, 1.1 x our clairvoyant SRTF);
* p99 JCT <= 1.1 x FIFO's;
* worst slowdown <= 0.1 x FIFO's;
* preemptions per job of the ``dlshare`` profile <= 1.0.

Run alone, it judges a profile on many seeds of every shape (the held-out check: a knob set a priori
should hold on seeds and shapes it was never looked at on), and optionally against another profile::

    python -m bench.sched_shapes --seeds 1,2,3 [--profile P.toml] [--vs dlshare] [--workers 2]

It prints, per seed, how many shapes meet each of the four targets, and with ``--vs`` the geometric
mean over every (shape, seed) case of the profile's figures over the other's, with how many cases got
better and worse.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# Our duration-agnostic baselines (the yardstick for the mean), the oracle, and the rest.
AGNOSTIC = ("las", "tiresias", "gittins", "fifo")
# A reference, not a baseline (not in AGNOSTIC): 2D-Gittins told the trace's own run-time distribution
# (never a job's own run time).  Where run times do not depend on the job's type (the synthetic shapes)
# that is the most a duration-agnostic order can know, and Gittins's index is the optimal
# non-anticipating order for the mean on one server (M/G/1): where even this one misses the mean
# target, the target is out of reach of the order alone (issue 23 asks misses to be explained).  On
# traces whose job types predict run times (the shared ones) a per-type order can do better.
KNOWN = "gittins-known"
SHAPE_POLICIES = ("fifo", "spread", "srtf", "las", "tiresias", "gittins", KNOWN, "gandiva", "horus", "iadeep",
                  "synergy", "dlshare")
QUICK_POLICIES = ("fifo", "srtf", "tiresias", "gittins", "dlshare")
QUICK_SHAPES = ("gang-small", "one-gpu-flood", "bursty")
COLUMNS = ["trace", "cluster", "policy", "avg_jct_h", "p99_jct_h", "worst_slowdown", "preemptions_per_job"]


def known_profile(trace: list[Any]) -> Any:
    """The :data:`KNOWN` reference for ``trace``: the ``gittins`` profile with the trace's run times
    (each job's isolated run time) as its distribution, learning nothing."""
    import dataclasses

    from scheduler.profile import PluginSpec, load_profile

    base = load_profile("gittins")
    return dataclasses.replace(base, name=KNOWN, order=PluginSpec(
        "gittins", {**base.order.args, "learn": False, "samples": [float(j.duration_s) for j in trace]}))


def run_profile(pol: str, trace: list[Any], profile: str) -> Any:
    """What :func:`run_shapes` simulates for the policy column ``pol``."""
    if pol == KNOWN:
        return known_profile(trace)
    return profile if pol == "dlshare" else pol


def run_shapes(quick: bool, seed: int, restart_s: float, policies: tuple[str, ...] | None = None,
               shapes: tuple[str, ...] | None = None, profile: str = "dlshare") -> list[dict[str, Any]]:
    """Every policy on every shape (``quick``: three shapes, five policies); one row per run.
    ``profile``: the profile judged as ours (a name or a TOML path; its row says ``dlshare``)."""
    from bench.shapes import ALL_SHAPES, make_trace
    from scheduler.sim import Cluster, simulate

    pols = policies or (QUICK_POLICIES if quick else SHAPE_POLICIES)
    wanted = shapes or (QUICK_SHAPES if quick else tuple(s.name for s in ALL_SHAPES))
    rows = []
    for shape in (s for s in ALL_SHAPES if s.name in wanted):
        trace = make_trace(shape, seed=seed + 1)
        for pol in pols:
            r = simulate(trace, Cluster.parse(shape.cluster), run_profile(pol, trace, profile), seed=seed,
                         trace_name=shape.name, restart_overhead_s=restart_s)
            m = r.metrics()
            rows.append({"trace": shape.name, "cluster": shape.cluster, "policy": pol, "jobs": m["jobs"],
                         **{k: m[k] for k in COLUMNS[3:]}, "median_jct_h": m["median_jct_h"],
                         "sim_wall_s": m["sim_wall_s"]})
            print(f"  shape {shape.name:13s} {pol:9s} mean {m['avg_jct_h']:8.2f} h  p99 {m['p99_jct_h']:8.1f} h  "
                  f"worst slowdown {m['worst_slowdown'] or 0:8.1f}  preemptions/job {m['preemptions_per_job']:.2f}",
                  flush=True)
    return rows


def _get(rows: list[dict[str, Any]], trace: str, pol: str, key: str) -> float | None:
    for r in rows:
        if r["trace"] == trace and r["policy"] == pol:
            return r.get(key)
    return None


def bounds(rows: list[dict[str, Any]], trace: str) -> dict[str, float | None]:
    """The issue's bounds on ``trace`` from the baselines in ``rows`` (None where a baseline is absent)."""
    agn = [v for p in AGNOSTIC if (v := _get(rows, trace, p, "avg_jct_h")) is not None]
    srtf = _get(rows, trace, "srtf", "avg_jct_h")
    fifo_p99 = _get(rows, trace, "fifo", "p99_jct_h")
    fifo_worst = _get(rows, trace, "fifo", "worst_slowdown")
    mean = None
    if agn:
        mean = max(0.8 * min(agn), 1.1 * srtf) if srtf is not None else 0.8 * min(agn)
    return {"mean": mean, "best_agnostic": min(agn) if agn else None, "srtf": srtf,
            "p99": 1.1 * fifo_p99 if fifo_p99 is not None else None,
            "worst_slowdown": 0.1 * fifo_worst if fifo_worst is not None else None}


def checks(rows: list[dict[str, Any]], ours: str = "dlshare") -> list[tuple[str, float | None, str, float | None]]:
    """Issue 23's four targets for ``ours`` on every trace in ``rows``."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        if _get(rows, trace, ours, "avg_jct_h") is None:
            continue
        b = bounds(rows, trace)
        out += [
            (f"{ours} mean JCT {trace} <= max(0.8 x best agnostic, 1.1 x SRTF) (h)",
             _get(rows, trace, ours, "avg_jct_h"), "<=", b["mean"]),
            (f"{ours} p99 JCT {trace} <= 1.1 x FIFO's (h)", _get(rows, trace, ours, "p99_jct_h"), "<=", b["p99"]),
            (f"{ours} worst slowdown {trace} <= 0.1 x FIFO's", _get(rows, trace, ours, "worst_slowdown"), "<=",
             b["worst_slowdown"]),
            (f"{ours} preemptions per job {trace}", _get(rows, trace, ours, "preemptions_per_job"), "<=", 1.0),
        ]
    return out


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trace: each policy's mean / p99 JCT (h), worst slowdown and preemptions per job."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        row: dict[str, Any] = {"trace": trace, "cluster": next(r["cluster"] for r in rows if r["trace"] == trace)}
        for r in rows:
            if r["trace"] != trace:
                continue
            worst = r["worst_slowdown"]
            row[r["policy"]] = (f"{r['avg_jct_h']:.1f} / {r['p99_jct_h']:.0f} / "
                                f"{worst if worst is None else f'{worst:.3g}'} / {r['preemptions_per_job']:.2f}")
        out.append(row)
    return out


TARGETS = ("mean", "p99", "worst slowdown", "preemptions")
TARGET_POLICIES = ("fifo", "srtf", *AGNOSTIC[:3], "dlshare")  # what the four targets are computed from
METRICS = ("avg_jct_h", "p99_jct_h", "worst_slowdown", "preemptions_per_job")


def _case(shape: str, seed: int, policy: str, restart_s: float, profile: str) -> dict[str, Any]:
    """One simulation: ``policy`` on ``shape``'s trace for ``seed`` (as :func:`run_shapes` runs it)."""
    rows = run_shapes(False, seed, restart_s, policies=(policy,), shapes=(shape,), profile=profile)
    return {**rows[0], "seed": seed}


def run_cases(seeds: tuple[int, ...], restart_s: float, policies: tuple[str, ...] = SHAPE_POLICIES,
              shapes: tuple[str, ...] | None = None, profile: str = "dlshare",
              workers: int = 1) -> list[dict[str, Any]]:
    """Every policy on every shape for every seed; rows carry their ``seed``.  ``profile`` is judged
    as ``dlshare`` (its rows say so).  ``workers`` processes (each simulation is independent)."""
    from bench.shapes import ALL_SHAPES

    wanted = shapes or tuple(s.name for s in ALL_SHAPES)
    jobs = [(sh, seed, pol, restart_s, profile) for seed in seeds for sh in wanted for pol in policies]
    if workers <= 1:
        return [_case(*j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_case, *zip(*jobs)))


def met_per_seed(rows: list[dict[str, Any]], ours: str = "dlshare") -> dict[int, dict[str, tuple[int, int]]]:
    """seed -> target -> (shapes where ``ours`` meets it, shapes judged), from :func:`checks`."""
    out: dict[int, dict[str, tuple[int, int]]] = {}
    for seed in sorted({r["seed"] for r in rows}):
        counts = {t: [0, 0] for t in TARGETS}
        for name, value, _, bound in checks([r for r in rows if r["seed"] == seed], ours):
            target = next(t for t in TARGETS if f" {t} " in name)
            if value is None or bound is None:
                continue
            counts[target][0] += value <= bound
            counts[target][1] += 1
        out[seed] = {t: (c[0], c[1]) for t, c in counts.items()}
    return out


def out_of_reach(rows: list[dict[str, Any]], ours: str = "dlshare") -> dict[int, tuple[int, int]]:
    """seed -> (shapes where ``ours`` misses the mean target, of those where :data:`KNOWN` misses it
    too): the misses no duration-agnostic order is shown to avoid.  Needs :data:`KNOWN`'s rows."""
    out: dict[int, tuple[int, int]] = {}
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        missed = both = 0
        for trace in dict.fromkeys(r["trace"] for r in mine):
            bound = bounds(mine, trace)["mean"]
            v, k = _get(mine, trace, ours, "avg_jct_h"), _get(mine, trace, KNOWN, "avg_jct_h")
            if bound is None or v is None or k is None or v <= bound:
                continue
            missed += 1
            both += k > bound
        out[seed] = (missed, both)
    return out


def compare(rows: list[dict[str, Any]], other: list[dict[str, Any]],
            ours: str = "dlshare") -> dict[str, dict[str, float]]:
    """For each metric: the geometric mean over the (shape, seed) cases in both of ``ours``'s figure in
    ``rows`` over its figure in ``other``, and how many cases got better (under 0.995) and worse
    (over 1.005).  Cases where either figure is 0 or missing are left out."""
    mine = {(r["trace"], r["seed"]): r for r in rows if r["policy"] == ours}
    theirs = {(r["trace"], r["seed"]): r for r in other if r["policy"] == ours}
    out = {}
    for metric in METRICS:
        ratios = [mine[k][metric] / theirs[k][metric] for k in mine.keys() & theirs.keys()
                  if mine[k].get(metric) and theirs[k].get(metric)]
        out[metric] = {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan"),
                       "better": sum(x < 0.995 for x in ratios), "worse": sum(x > 1.005 for x in ratios),
                       "cases": len(ratios)}
    return out


def main(argv: list[str] | None = None) -> int:
    from scheduler.sim import RESTART_COST_S

    ap = argparse.ArgumentParser(description="Issue 23's targets for a profile on many seeds of every shape.")
    ap.add_argument("--seeds", default="0", help="comma-separated trace seeds (default 0; 1,2,3: held out)")
    ap.add_argument("--profile", default="dlshare", help="the profile judged (a name or a TOML path)")
    ap.add_argument("--vs", default="", help="another profile: ratios of the judged one's figures over it")
    ap.add_argument("--shapes", default="", help="comma-separated shapes (default: all)")
    ap.add_argument("--restart-cost", type=float, default=RESTART_COST_S, metavar="S")
    ap.add_argument("--workers", type=int, default=1, help="simulations at once")
    ap.add_argument("--known", action="store_true",
                    help=f"also run {KNOWN} (2D-Gittins told each trace's run-time distribution) and count "
                         "the mean misses it shares")
    ap.add_argument("--json", default="", help="write every row here")
    a = ap.parse_args(argv)
    try:
        seeds = tuple(int(x) for x in a.seeds.split(",") if x)
    except ValueError:
        ap.error(f"--seeds: comma-separated integers, not {a.seeds!r}")
    shapes = tuple(x for x in a.shapes.split(",") if x) or None
    rows = run_cases(seeds, a.restart_cost, policies=(*TARGET_POLICIES, *((KNOWN,) if a.known else ())),
                     shapes=shapes, profile=a.profile, workers=a.workers)
    other = (run_cases(seeds, a.restart_cost, policies=("dlshare",), shapes=shapes, profile=a.vs,
                       workers=a.workers) if a.vs else [])
    total = {t: [0, 0] for t in TARGETS}
    for seed, counts in met_per_seed(rows).items():
        print(f"seed {seed}: " + ", ".join(f"{t} {m}/{n}" for t, (m, n) in counts.items()))
        for t, (m, n) in counts.items():
            total[t][0] += m
            total[t][1] += n
    print("all seeds: " + ", ".join(f"{t} {m}/{n}" for t, (m, n) in total.items()))
    if a.known:
        reach = out_of_reach(rows)
        print(f"mean target missed, and missed by {KNOWN} too: " + ", ".join(
            f"seed {seed} {both} of {missed}" for seed, (missed, both) in reach.items()))
    if other:
        for metric, c in compare(rows, other).items():
            print(f"{metric}: {a.profile} / {a.vs} geometric mean {c['geomean']:.3f} over {c['cases']} cases "
                  f"({c['better']} better, {c['worse']} worse)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "vs_rows": other}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
