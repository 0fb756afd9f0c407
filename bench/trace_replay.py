"""What the live trace replays (``bench slurm``, ``bench k8s``) share: the simulator's answer on the
same scaled slice, and the percentile they report."""

from __future__ import annotations

import math
from typing import Any


def simulate(trace: list[Any], nodes: int, gpus: int, cpus: int, mem_mb: int) -> dict[str, dict[str, float]]:
    """The ``dlshare`` and ``fifo`` profiles on ``nodes`` nodes of ``gpus`` GPUs, ``cpus`` CPUs and
    ``mem_mb`` MiB, as the live run has them.  No telemetry reaches the simulated core
    (``report_delay_s``: never), as none reaches the live one."""
    from scheduler.predictors import Predictors
    from scheduler.sim import Cluster, simulate as sim

    cluster = Cluster(nodes, gpus, cpus, mem_mb * (1 << 20) / 1e9)
    out = {}
    for prof in ("dlshare", "fifo"):
        m = sim(trace, cluster, prof, predictors=Predictors.from_data(), report_delay_s=1e15).metrics()
        out[prof] = {"mean_jct_s": m["avg_jct_h"] * 3600, "p99_jct_s": m["p99_jct_h"] * 3600,
                     "makespan_s": m["makespan_h"] * 3600, "preemptions": m["preemptions"]}
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``xs`` (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
