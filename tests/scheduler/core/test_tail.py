"""The tail bound of the preemptive orders: boosted arrival times (scheduler.plugins.tail)."""

import numpy as np
import pytest

from scheduler import Job
from scheduler.framework import Context
from scheduler.model import JobRecord
from scheduler.plugins.ordering import Gittins, GittinsTable
from scheduler.plugins.tail import BoostedArrival
from scheduler.predictors import Predictors
from scheduler.profile import parse_profile
from scheduler.sim import Cluster, simulate
from scheduler.trace import TraceJob


def test_boost_grows_with_the_rate_and_the_horizon_is_learned():
    b = BoostedArrival(10.0, prior_mean_s=100.0, min_samples=3)
    assert b.horizon_s == 1000.0  # the prior's mean until enough jobs finished
    assert b.boost(0.0) == 0.0
    assert 0 < b.boost(1e-4) < b.boost(1e-2) < b.boost(1.0)
    for rt in (10.0, 20.0, 30.0):
        b.observe(rt)
    assert b.horizon_s == pytest.approx(200.0)  # 10 x the mean run time of finished jobs
    # a job expected to need far more than T keeps (almost) its arrival place
    assert b.boost(1.0 / (100 * b.horizon_s)) < 0.011 * b.horizon_s
    with pytest.raises(ValueError):
        BoostedArrival(0.0, 100.0)


def _rec(jid, arrival, service=0.0, gpus=1):
    return JobRecord(Job(jid, "m", gpus=gpus, arrival=arrival, attained_service=service))


def _ctx(now):
    import random

    return Context(now=now, records={}, nodes={}, predictors=Predictors(), rng=random.Random(0))


def test_boosted_gittins_lets_newcomers_pass_only_within_the_boost():
    g = Gittins(learn=False, boost=10.0)
    g.table = GittinsTable(np.random.default_rng(1).pareto(1.0, 5000) * 60 + 1)
    old = _rec("old", arrival=0.0, service=50_000.0)  # has run ~14 h: looks long
    ctx = _ctx(100_000.0)
    fresh_rate = g.table(0.0)
    b_fresh = g.boost.boost(fresh_rate)
    b_old = g.boost.boost(g.table(50_000.0))
    assert b_fresh > b_old
    soon = _rec("soon", arrival=0.5 * (b_fresh - b_old))
    late = _rec("late", arrival=2.0 * (b_fresh - b_old))
    keys = {r.job.id: g.key(r, ctx) for r in (old, soon, late)}
    assert keys["soon"] < keys["old"] < keys["late"]
    # without the boost the index alone decides: every fresh job goes first, however late it came
    plain = Gittins(learn=False)
    plain.table = g.table
    assert plain.key(late, ctx) < plain.key(old, ctx)


def _profile(**order_args):
    return parse_profile({"name": "t", "order": {"plugin": "gittins", "args": {"learn": True, **order_args}},
                          "score": [{"plugin": "consolidate"}]})


def _stream(hours=1000.0):
    """One 100-hour job, then a 30-minute job every 36 minutes for ``hours``: the short jobs
    alone offer 83% of the one GPU, and keep coming long after the long job would be done."""
    jobs = [TraceJob("long", 0.0, "ResNet-18", 32, 1, 0, 100 * 3600.0)]
    t, k = 60.0, 0
    while t < hours * 3600.0:
        jobs.append(TraceJob(f"s{k}", t, "ResNet-18", 32, 1, 0, 1800.0))
        t += 2160.0
        k += 1
    return jobs


def _jct(result, trace, jid):
    ids = [tj.id for tj in sorted(trace, key=lambda tj: tj.arrival_s)]
    return float(result.jct_s[ids.index(jid)])


def test_a_stream_of_short_jobs_starves_a_long_one_without_the_bound_but_not_with_it():
    trace = _stream()
    cl = Cluster.parse("1x1")
    plain = simulate(trace, cl, _profile(), restart_overhead_s=0.0)
    boosted = simulate(trace, cl, _profile(boost=10.0), restart_overhead_s=0.0)
    fifo = simulate(trace, cl, "fifo", restart_overhead_s=0.0)
    long_plain, long_boost = _jct(plain, trace, "long"), _jct(boosted, trace, "long")
    # plain Gittins runs the long job only in the stream's gaps: ~ 100 h / 17% of the GPU
    assert long_plain > 500 * 3600.0
    # with boosted arrivals it is overtaken only by jobs that came soon after it (here T = 10 x
    # the 30-minute mean run time): it finishes close to its FIFO time
    assert long_boost < 1.25 * _jct(fifo, trace, "long")
    # ... and no job pays for that more than under FIFO
    assert boosted.jct_s.mean() <= 1.05 * fifo.jct_s.mean()
    assert plain.metrics()["worst_slowdown"] >= 5.9 and boosted.metrics()["worst_slowdown"] >= 1.0


def test_the_share_bound_gives_a_starved_long_job_half_its_equal_share():
    """Issue 23: the bound that replaced the fixed boost.  One long job and a stream of short ones on one
    GPU: plain Gittins runs the long job only in the stream's gaps; with the bound it gets at least
    half an equal share once it is short of it, and finishes far earlier."""
    trace = _stream()
    cl = Cluster.parse("1x1")
    plain = simulate(trace, cl, _profile(prior_jobs=20.0))
    bound = simulate(trace, cl, _profile(prior_jobs=20.0, share_bound=2.0))
    long_plain, long_bound = _jct(plain, trace, "long"), _jct(bound, trace, "long")
    assert long_bound < 0.95 * long_plain
    # an equal share here is about half the GPU (the long job and one short one), so half of it is a
    # quarter: 100 h of work in at most ~400 h, plus the stretches between promotions
    assert long_bound < 600 * 3600.0
    assert bound.metrics()["preemptions_per_job"] < 1.0
