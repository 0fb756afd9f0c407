"""bench/shapes.py: seeded synthetic traces of other shapes (for checking a priori knobs)."""

import numpy as np
import pytest

from bench.shapes import ALL_SHAPES, CLUSTER_SHAPES, SHAPES, Shape, make_trace
from scheduler.sim import Cluster


def _offered_load(trace, cluster):
    cl = Cluster.parse(cluster)
    work = sum(t.duration_s * t.gpus for t in trace)
    span = max(t.arrival_s for t in trace) - min(t.arrival_s for t in trace)
    return work / (span * cl.nodes * cl.gpus)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=[s.name for s in ALL_SHAPES])
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


def test_cluster_shapes_have_the_gpu_mix_and_load_they_name():
    gang = make_trace(next(s for s in CLUSTER_SHAPES if s.name == "gang-small"), seed=1)
    assert np.mean([t.gpus == 8 for t in gang]) == pytest.approx(0.79, abs=0.05)
    flood = make_trace(next(s for s in CLUSTER_SHAPES if s.name == "one-gpu-flood"), seed=1)
    assert {t.gpus for t in flood} == {1}
    for shape in CLUSTER_SHAPES:
        assert _offered_load(make_trace(shape, seed=1), shape.cluster) == pytest.approx(shape.load, rel=0.15)
    # Gavel's law: 10^U(1.5, 4) minutes, so 31 min to 167 h, median near 4.6 h
    d = np.array([t.duration_s for t in make_trace(Shape("x", "8x4", 2000, durations="gavel"), seed=2)])
    assert d.min() >= 60 * 10 ** 1.5 * 0.999 and np.median(d) / 3600 == pytest.approx(4.6, rel=0.25)
    assert SHAPES[0] in ALL_SHAPES and CLUSTER_SHAPES[0] in ALL_SHAPES
