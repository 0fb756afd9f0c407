"""``dlshare bench sched``, part ``mixed`` (issue 23): a cluster of three GPU generations.

Philly vc_0e4a51 on one third each of V100, P100 and K80 servers (6 x 4 GPUs of each: on 16 x 4 the
thirds would not be whole servers).  Each job runs on each generation at its speed there from
Gavel's measured throughputs (the simulator's ground truth; the trace's durations are V100 times).
The ``dlshare`` profile places by generation (the ``gpu_type`` filter and score); the
heterogeneity-blind policies are our other orders and ``dlshare`` itself without its generation
plugins.  ``mixed_vs_blind`` is dlshare's mean JCT over the best blind policy's (target <= 0.8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

CLUSTER = "6x4@v100,6x4@p100,6x4@k80"
TRACE = "vc_0e4a51"
BLIND = ("fifo", "las", "tiresias", "gittins", "dlshare-blind")
QUICK_BLIND = ("fifo", "gittins", "dlshare-blind")


def blind(profile: Any) -> Any:
    """``profile`` without its GPU-generation plugins: the same policy, blind to the generations."""
    return dataclasses.replace(profile, name=f"{profile.name}-blind",
                               filters=tuple(f for f in profile.filters if f.plugin != "gpu_type"),
                               scores=tuple(s for s in profile.scores if s.plugin != "gpu_type"))


def mixed(quick: bool, seed: int, restart_s: float, cluster: str = CLUSTER, trace_name: str = TRACE,
          trace: list[Any] | None = None, profile: str = "dlshare") -> dict[str, Any]:
    """Every blind policy and ``profile`` on the mixed cluster; rows and the ``mixed_*`` metrics."""
    from scheduler import data
    from scheduler.profile import load_profile
    from scheduler.sim import Cluster, simulate
    from scheduler.trace import load_trace

    if trace is None:
        trace = load_trace(data.resolve_trace(trace_name))
    cl = Cluster.parse(cluster)
    ours = load_profile(profile)
    rows = []
    for pol in (*(QUICK_BLIND if quick else BLIND), "dlshare"):
        prof = blind(ours) if pol == "dlshare-blind" else (ours if pol == "dlshare" else pol)
        m = simulate(trace, cl, prof, seed=seed, trace_name=trace_name, restart_overhead_s=restart_s).metrics()
        rows.append({"trace": trace_name, "cluster": cluster, "policy": pol, "avg_jct_h": m["avg_jct_h"],
                     "p99_jct_h": m["p99_jct_h"], "worst_slowdown": m["worst_slowdown"],
                     "preemptions_per_job": m["preemptions_per_job"], "gpu_util": m["gpu_util"],
                     "sim_wall_s": m["sim_wall_s"]})
        print(f"  mixed {trace_name} {cluster} {pol:13s} mean {m['avg_jct_h']:8.2f} h  p99 {m['p99_jct_h']:8.1f} h  "
              f"preemptions/job {m['preemptions_per_job']:.2f}", flush=True)
    best = min((r for r in rows if r["policy"] != "dlshare"), key=lambda r: r["avg_jct_h"])
    ours_row = next(r for r in rows if r["policy"] == "dlshare")
    metrics = {"mixed_vs_blind": ours_row["avg_jct_h"] / best["avg_jct_h"], "mixed_best_blind": best["policy"],
               "mixed_dlshare_jct_h": ours_row["avg_jct_h"], "mixed_best_blind_jct_h": best["avg_jct_h"],
               "mixed_cluster": cluster}
    return {"rows": rows, "metrics": metrics}


def checks(metrics: dict[str, Any]) -> list[tuple[str, float | None, str, float | None]]:
    return [("mixed_vs_blind: dlshare mean JCT over the best blind policy's, mixed cluster",
             metrics.get("mixed_vs_blind"), "<=", 0.8)]
