"""bench/shapes.py: seeded synthetic traces of other shapes (for checking a priori knobs)."""

import numpy as np
import pytest

from bench.shapes import SHAPES, Shape, make_trace
from scheduler.sim import Cluster


def _offered_load(trace, cluster):
    cl = Cluster.parse(cluster)
    work = sum(t.duration_s * t.gpus for t in trace)
    span = max(t.arrival_s for t in trace) - min(t.arrival_s for t in trace)
    return work / (span * cl.nodes * cl.gpus)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_each_shape_is_seeded_and_fits_its_cluster(shape):
    a, b = make_trace(shape, seed=3), make_trace(shape, seed=3)
    assert a == b and len(a) == shape.jobs
    assert make_trace(shape, seed=4) != a
    cl = Cluster.parse(shape.cluster)
    assert all(1 <= t.gpus <= cl.nodes * cl.gpus and t.duration_s >= 60 for t in a)
    assert [t.arrival_s for t in a] == sorted(t.arrival_s for t in a)


def test_shapes_differ_where_they_say():
    base = Shape("x", "8x4", 800)
    low, high = make_trace(Shape("x", "8x4", 800, load=0.5)), make_trace(Shape("x", "8x4", 800, load=1.3))
    assert _offered_load(low, "8x4") < 0.6 and _offered_load(high, "8x4") > 1.1
    gaps = np.diff([t.arrival_s for t in make_trace(Shape("x", "8x4", 800, bursts=4))])
    even = np.diff([t.arrival_s for t in make_trace(base)])
    assert np.percentile(gaps, 99) / np.median(gaps) > 5 * np.percentile(even, 99) / np.median(even)
    heavy = np.array([t.duration_s for t in make_trace(Shape("x", "8x4", 800, durations="pareto"))])
    assert np.median(heavy) == pytest.approx(1800, rel=0.3)
    wide = make_trace(Shape("x", "4x8", 800, wide=True))
    assert np.mean([t.gpus >= 4 for t in wide]) > np.mean([t.gpus >= 4 for t in make_trace(base)])
