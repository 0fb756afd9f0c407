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
"""

from __future__ import annotations

from typing import Any

# Our duration-agnostic baselines (the yardstick for the mean), the oracle, and the rest.
AGNOSTIC = ("las", "tiresias", "gittins", "fifo")
SHAPE_POLICIES = ("fifo", "spread", "srtf", "las", "tiresias", "gittins", "gandiva", "horus", "iadeep", "synergy",
                  "dlshare")
QUICK_POLICIES = ("fifo", "srtf", "tiresias", "gittins", "dlshare")
QUICK_SHAPES = ("gang-small", "one-gpu-flood", "bursty")
COLUMNS = ["trace", "cluster", "policy", "avg_jct_h", "p99_jct_h", "worst_slowdown", "preemptions_per_job"]


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
            r = simulate(trace, Cluster.parse(shape.cluster), profile if pol == "dlshare" else pol, seed=seed,
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
