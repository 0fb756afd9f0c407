"""Seeded synthetic traces of shapes the shared traces do not cover.

The tail bound and the other policy knobs are set a priori; these traces
check them on workloads they were never looked at on: heavier duration tails,
bursty arrivals, low and overloaded clusters, a small cluster, wide jobs.
Every trace is drawn from a seeded generator, so a run is reproducible.

Job types and GPU counts come from a fixed Philly-like mix (the counts of
1/2/4/8-GPU jobs seen in Philly's virtual clusters), durations from the
Philly runtime distribution (philly/runtimes.csv) or a Pareto law; arrival
times are placed so the trace offers ``load`` of the cluster's GPU-time over
its span.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.trace import TraceJob

# (model, batch size) pairs Gavel measured, so co-location follows its pair table.
_TYPES = [("ResNet-18", 32), ("ResNet-50", 64), ("Transformer", 128), ("LM", 20), ("Recommendation", 2048),
          ("CycleGAN", 0), ("A3C", 0)]
# Share of jobs by GPU count, rounded from Philly vc_0e4a51 (436/164/339/45 of 984 jobs).
_GPUS = {1: 0.44, 2: 0.17, 4: 0.34, 8: 0.05}


@dataclass(frozen=True)
class Shape:
    name: str
    cluster: str
    jobs: int
    load: float = 0.8
    durations: str = "philly"  # philly | pareto
    bursts: int = 0  # 0: arrivals uniform over the span; else this many bursts
    wide: bool = False  # more multi-GPU jobs
    note: str = ""


SHAPES = [
    Shape("philly-like", "8x4", 600, note="Philly durations, uniform arrivals, load 0.8"),
    Shape("heavy-tail", "8x4", 600, durations="pareto", note="Pareto(1.1) durations, median 30 min"),
    Shape("bursty", "8x4", 600, bursts=6, note="six bursts of arrivals"),
    Shape("low-load", "8x4", 600, load=0.5, note="load 0.5"),
    Shape("overload", "8x4", 600, load=1.3, note="load 1.3: the queue only grows"),
    Shape("small", "2x4", 300, note="8 GPUs, load 0.8"),
    Shape("wide", "4x8", 500, wide=True, note="half the jobs take 4-8 GPUs"),
]


def _durations(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "philly":
        from scheduler import data

        return rng.choice(data.philly_runtimes(), n)
    if kind == "pareto":
        # Pareto, shape 1.1 (heavier than Philly's), scaled to a 30-minute median.
        return 1800.0 / 2 ** (1 / 1.1) * (1.0 + rng.pareto(1.1, n))
    raise ValueError(f"unknown duration law {kind!r}")


def make_trace(shape: Shape, seed: int = 0) -> list[TraceJob]:
    """The trace of ``shape`` drawn with ``seed``."""
    from scheduler.sim import Cluster

    rng = np.random.default_rng(seed)
    cl = Cluster.parse(shape.cluster)
    total = cl.nodes * cl.gpus
    n = shape.jobs
    sizes = np.array(sorted(_GPUS))
    p = np.array([_GPUS[s] for s in sizes])
    if shape.wide:
        p = np.array([0.3, 0.2, 0.3, 0.2])
    gpus = rng.choice(sizes, n, p=p / p.sum())
    gpus = np.minimum(gpus, total)
    raw = _durations(shape.durations, n, rng)
    # Clip to 1 min .. a quarter of the span, so the offered load really lands inside the span.
    hi = 30 * 86400.0
    for _ in range(8):
        d = np.clip(raw, 60.0, hi)
        span = float((d * gpus).sum()) / (shape.load * total)
        hi = max(3600.0, span / 4.0)
    d = np.clip(raw, 60.0, hi)
    span = float((d * gpus).sum()) / (shape.load * total)
    if shape.bursts:
        centres = rng.uniform(0.0, span, shape.bursts)
        arrivals = np.clip(centres[rng.integers(0, shape.bursts, n)] + rng.exponential(span / 100.0, n), 0, span)
    else:
        arrivals = rng.uniform(0.0, span, n)
    order = np.argsort(arrivals, kind="stable")
    out = []
    for k, i in enumerate(order):
        model, bs = _TYPES[rng.integers(0, len(_TYPES))]
        out.append(TraceJob(str(k), float(arrivals[i]), model, bs, int(gpus[i]), 0, float(d[i])))
    return out
