"""``dlshare bench sched``, memory-short part: lent memory on Synergy's static_100job.

The cluster is Synergy's (4 servers x 8 GPUs, 24 cores) with **250 GB** per server instead of 500,
plus 2 CPU-only data-preparation nodes with 500 GB lendable each.  Same trace, same FIFO order and
consolidating placement in every run; only the memory and the allocator change:

* (a) ``synergy``: Synergy-style tuning, local memory only (the memory-short baseline);
* (a') the ``lent`` plugin's level greedy on local memory and cores only, no donor: separates what
  lent memory adds from what the better greedy adds;
* (b) ``lent``: the same greedy with the donors' memory, at the measured remote efficiency;
* (b, reclaim) as (b), but each donor takes half its memory back at half of (b)'s makespan (and,
  early, at a tenth of it, while most lent memory is in use);
* (b, slow link) as (b) on a link 10x slower than measured (what the efficiency model changes);
* (c) ``synergy`` on the unconstrained 500 GB servers (the bound).

``memshort_recovered = (a - b) / (a - c)``: the share of the JCT the memory cut costs that lent
memory wins back (also given against (a')).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

GB = 10 ** 9
TRACE = "static_100job"
SERVERS, GPUS, CORES = 4, 8, 24
SHORT_GB, FULL_GB = 250.0, 500.0
DONORS, LEND_GB = 2, 500


def _profile(allocate: str, **args: Any) -> Any:
    from scheduler.profile import PluginSpec, load_profile

    base = load_profile("synergy")
    return replace(base, name=f"synergy+{allocate}", allocate=PluginSpec(allocate, dict(args)))


def memshort(seed: int = 0, short_gb: float = SHORT_GB, link: Any = None) -> dict[str, Any]:
    """Run (a), (a'), (b), (b reclaim), (b slow link), (c); returns the metrics and the rows.
    ``link``: the RemoteLink the lent runs use (default: the code's, the last recorded measurement)."""
    from scheduler import data
    from scheduler.model import Node
    from scheduler.remote_memory import RemoteLink
    from scheduler.sim import Cluster, simulate
    from scheduler.trace import load_trace

    trace = load_trace(data.resolve_trace(TRACE))
    short = Cluster.parse(f"{SERVERS}x{GPUS}:{CORES}:{short_gb:g}")
    full = Cluster.parse(f"{SERVERS}x{GPUS}:{CORES}:{FULL_GB:g}")
    donors = [Node(f"prep{i}", 0, CORES, LEND_GB * GB, lendable_bytes=LEND_GB * GB) for i in range(DONORS)]
    lent = _profile("lent")
    link = link if link is not None else RemoteLink()
    rows: list[dict[str, Any]] = []

    def run(name: str, cluster: Any, profile: Any, **kw: Any) -> Any:
        r = simulate(trace, cluster, profile, seed=seed, trace_name=TRACE, **kw)
        m = r.metrics()
        rows.append({"run": name, "memory_gb": cluster.memory_gb, "avg_jct_h": m["avg_jct_h"],
                     "p99_jct_h": m["p99_jct_h"], "makespan_h": m["makespan_h"], "failed": m["failed"],
                     "lent_peak_gb": m.get("lent_peak_bytes", 0) / GB,
                     "lent_reclaimed_gb": m.get("lent_reclaimed_bytes", 0) / GB, "sim_wall_s": m["sim_wall_s"]})
        print(f"  memshort {name:28s} avg JCT {m['avg_jct_h']:7.2f} h  p99 {m['p99_jct_h']:7.2f} h  "
              f"({m['sim_wall_s']:.1f} s)", flush=True)
        return r

    a = run(f"(a) synergy, local {short_gb:g} GB", short, "synergy")
    a2 = run("(a') lent greedy, no donors", short, _profile("lent", levels_without_donors=True))
    b = run("(b) lent, 2 donors x 500 GB", short, lent, donors=donors, remote_link=link)
    mid = b.makespan_s / 2.0
    reclaims = [(mid, d.id, d.lendable_bytes // 2) for d in donors]
    b_rec = run("(b) lent, donors reclaim half", short, lent, donors=donors, reclaims=reclaims, remote_link=link)
    early = b.makespan_s / 10.0  # while the queue is long and most lent memory is in use
    b_early = run("(b) lent, reclaim half early", short, lent, donors=donors,
                  reclaims=[(early, d.id, d.lendable_bytes // 2) for d in donors], remote_link=link)
    slow = replace(link, read_bytes_per_s=link.read_bytes_per_s / 10, donor_bytes_per_s=link.donor_bytes_per_s / 10)
    b_slow = run("(b) lent, link 10x slower", short, lent, donors=donors, remote_link=slow)
    c = run(f"(c) synergy, local {FULL_GB:g} GB", full, "synergy")
    h = 3600.0
    av = {k: float(r.jct_s.mean() / h) for k, r in
          (("a", a), ("a2", a2), ("b", b), ("rec", b_rec), ("early", b_early), ("slow", b_slow), ("c", c))}
    cut = av["a"] - av["c"]
    cut2 = av["a2"] - av["c"]
    metrics = {
        "memshort_local_jct_h": av["a"], "memshort_local_levels_jct_h": av["a2"], "memshort_lent_jct_h": av["b"],
        "memshort_unconstrained_jct_h": av["c"], "memshort_reclaim_jct_h": av["rec"],
        "memshort_slow_link_jct_h": av["slow"],
        "memshort_recovered": (av["a"] - av["b"]) / cut if cut > 1e-9 else None,
        "memshort_recovered_vs_levels": (av["a2"] - av["b"]) / cut2 if cut2 > 1e-9 else None,
        "memshort_cut_costs_h": cut, "memshort_reclaim_at_h": mid / h,
        "memshort_lent_peak_gb": b.lent_peak_bytes / GB,
        "memshort_reclaim_taken_back_gb": b_rec.lent.get("reclaimed_bytes", 0) / GB,
        "memshort_reclaim_early_jct_h": av["early"], "memshort_reclaim_early_at_h": early / h,
        "memshort_reclaim_early_taken_back_gb": b_early.lent.get("reclaimed_bytes", 0) / GB,
        "memshort_link": link.source,
    }
    return {"metrics": metrics, "rows": rows}


def checks(m: dict[str, Any]) -> list[tuple[str, Any, str, Any]]:
    return [
        ("memshort_recovered = (a - b) / (a - c)", m["memshort_recovered"], ">=", 0.8),
        ("memshort_recovered against (a') the same greedy without donors", m["memshort_recovered_vs_levels"], ">=",
         0.8),
        ("memshort_reclaim_jct_h vs (a) local only", m["memshort_reclaim_jct_h"], "<=", m["memshort_local_jct_h"]),
        ("memshort_reclaim_early_jct_h vs (a) local only", m["memshort_reclaim_early_jct_h"], "<=",
         m["memshort_local_jct_h"]),
    ]
