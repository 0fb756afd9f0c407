"""Issue 23: the learned run-time distribution, the equal-share tail bound, the preemption margin and the
preemptive pass's pinned jobs."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from scheduler import Job, JobArrived, JobFinished, Node, SchedulerState, Tick
from scheduler.events import Place, Preempt
from scheduler.framework import Context
from scheduler.ledger import ShareClock
from scheduler.model import GiB, JobRecord
from scheduler.plugins.durations import GittinsTable, LearnedDurations, kaplan_meier
from scheduler.plugins.ordering import Gittins
from scheduler.plugins.tail import ShareBound
from scheduler.predictors import Predictors
from scheduler.profile import ProfileError, parse_profile


def test_kaplan_meier_without_censoring_is_the_histogram_and_censoring_moves_mass_later():
    ev = np.array([1.0, 2.0, 1.0, 0.0])
    assert kaplan_meier(ev, np.zeros(4)) == pytest.approx(ev / ev.sum())
    # two jobs still running in bin 1: they did not end there, so bins 2.. get more of the mass
    with_cens = kaplan_meier(ev, np.array([0.0, 2.0, 0.0, 0.0]))
    assert with_cens.sum() == pytest.approx(1.0)
    # bin 0: 6 at risk (the censored ones too), 1 ends; bin 1: 5 at risk, 2 end; bin 2: the last one
    assert with_cens[:3] == pytest.approx([1 / 6, 1 / 3, 1 / 2])
    # everyone censored: the survivors' mass goes to the last bin seen, nothing is lost (Efron)
    assert kaplan_meier(np.zeros(4), np.array([1.0, 1.0, 1.0, 0.0])) == pytest.approx([0.0, 0.0, 1.0, 0.0])


def _gavel_like(n, rng):
    lo = np.where(rng.random(n) < 0.8, 1.5, 3.0)
    return 60.0 * 10.0 ** rng.uniform(lo, lo + np.where(lo < 2.0, 1.5, 1.0))


def test_learned_durations_forget_a_wrong_prior_and_need_the_censored_jobs():
    rng = np.random.default_rng(0)
    prior = rng.pareto(1.0, 20000) * 60 + 60  # Philly-like: minutes
    truth = _gavel_like(4000, rng)  # hours
    true_table = GittinsTable(truth)

    def learn(censor):
        ld = LearnedDurations(prior, prior_jobs=20.0)
        # the short jobs finish first; the long ones are still running when the estimate is made
        done = np.sort(truth)[:200]
        for d in done:
            ld.observe(("m", 1), float(d))
        running = [(("m", 1), float(min(d, done[-1]))) for d in np.sort(truth)[200:400]] if censor else []
        ld.rebuild(running)
        return ld.table

    fresh = GittinsTable(prior)
    learned, naive = learn(True), learn(False)
    # expected run time of a fresh job: the prior says minutes, the workload hours
    assert fresh.expected_total(0.0) < 0.2 * true_table.expected_total(0.0)
    assert learned.expected_total(0.0) > 3 * naive.expected_total(0.0)
    assert naive.expected_total(0.0) < learned.expected_total(0.0) <= 1.5 * true_table.expected_total(0.0)


def test_learned_durations_rebuild_a_tenth_at_a_time_and_per_type():
    ld = LearnedDurations(np.full(100, 100.0), prior_jobs=20.0, type_prior_jobs=20.0)
    assert ld.due() is False
    for k in range(30):
        ld.observe(("a", 1), 10_000.0)
        if ld.due():
            ld.rebuild([])
    assert ld.version < 30 and ld.finished == 30  # not once per job
    # a type with history is ranked by it; an unseen type by the workload's distribution
    assert ld.for_type(("b", 1)) is ld.table
    assert ld.for_type(("a", 1)).expected_total(0.0) > 50.0 * 100.0


def _rec(jid, arrival=0.0, service=0.0, gpus=1, share_start=0.0, running=False):
    r = JobRecord(Job(jid, "m", gpus=gpus, arrival=arrival, attained_service=service), share_start=share_start)
    if running:
        r.run_since = arrival
    return r


def _ctx(now, share_clock):
    """A context whose equal-share clock reads ``share_clock`` for every job size."""
    return Context(now=now, records={}, nodes={}, predictors=Predictors(), rng=random.Random(0),
                   share_clock=lambda gpus: share_clock)


def test_share_clock_runs_at_the_equal_share_and_counts_demand_and_capacity():
    c = ShareClock()
    c.change(0.0, capacity=4.0)
    c.change(0.0, gpus=1, jobs=2)
    assert c.at(100.0, 1) == pytest.approx(100.0)  # room for everyone: a second of run time a second
    c.change(100.0, gpus=2, jobs=3)  # 8 GPUs asked for on 4, by five jobs: 0.8 GPU each
    assert c.demand == 8 and c.level == pytest.approx(0.8)
    assert c.at(300.0, 1) == pytest.approx(100.0 + 200 * 0.8)
    assert c.at(300.0, 2) == pytest.approx(200 * 0.4)  # its clock started when the first 2-GPU job came
    c.change(300.0, gpus=1, jobs=-2)
    c.change(300.0, gpus=2, jobs=-3)
    assert c.demand == 0 and c.rate(8) == 1.0 and c.values == {}
    # a job asking for no GPU runs all the time, whatever changes meanwhile
    start = c.at(310.0, 0)
    c.change(320.0, gpus=4, jobs=9)
    assert c.at(400.0, 0) - start == pytest.approx(90.0)


def test_share_clock_is_max_min_fair_between_job_sizes():
    """Every job is entitled to the same GPUs; a small job gets what it asks for and the rest go to the
    wide ones: on 12 GPUs, two 1-GPU jobs run all the time and four 8-GPU jobs share the other 10."""
    c = ShareClock()
    c.change(0.0, capacity=12.0)
    c.change(0.0, gpus=1, jobs=2)
    c.change(0.0, gpus=8, jobs=4)
    assert c.level == pytest.approx(2.5)
    assert c.rate(1) == 1.0 and c.rate(8) == pytest.approx(2.5 / 8)
    assert 2 * c.rate(1) * 1 + 4 * c.rate(8) * 8 == pytest.approx(12.0)  # the shares fill the cluster
    # a job entitled to more than a small one asks for never takes from it: three 2-GPU jobs and a
    # 16-GPU one on 12 GPUs: each 2-GPU job has its 2, the wide one the 6 left
    d = ShareClock()
    d.change(0.0, capacity=12.0)
    d.change(0.0, gpus=2, jobs=3)
    d.change(0.0, gpus=16, jobs=1)
    assert d.level == pytest.approx(6.0) and d.rate(2) == 1.0 and d.rate(16) == pytest.approx(6 / 16)
    # a crowd of equal jobs: the even split, whatever their size
    e = ShareClock()
    e.change(0.0, capacity=8.0)
    e.change(0.0, gpus=4, jobs=4)
    assert e.rate(4) == pytest.approx(0.5)
    # no capacity (every node down): nobody is entitled to anything, the clocks stop
    e.change(10.0, capacity=-8.0)
    assert e.rate(4) == 0.0 and e.at(50.0, 4) == pytest.approx(5.0)


@settings(max_examples=300, deadline=None)
@given(jobs=hst.dictionaries(hst.integers(1, 64), hst.integers(1, 30), max_size=8),
       capacity=hst.floats(0.0, 600.0, allow_nan=False))
def test_share_clock_shares_are_max_min_fair(jobs, capacity):
    """Whatever the crowd: the shares fill the cluster (or every job has what it asks for), no job is
    given more than it asks for, and a job short of what it asks for has at least what any other job
    has (max-min fairness)."""
    c = ShareClock()
    c.change(0.0, capacity=capacity)
    for g, n in jobs.items():
        c.change(0.0, gpus=g, jobs=n)
    given_gpus = {g: c.rate(g) * g for g in jobs}
    demand = sum(g * n for g, n in jobs.items())
    assert c.demand == demand
    assert sum(given_gpus[g] * n for g, n in jobs.items()) == pytest.approx(min(capacity, demand), abs=1e-6)
    for g, have in given_gpus.items():
        assert have <= g + 1e-9
        if have < g - 1e-9:
            assert all(have >= other - 1e-6 for other in given_gpus.values())


def test_the_core_starts_each_job_on_its_own_size_clock():
    """The ledger's context reads the clock of the job's own size; a wide job is owed later than a
    narrow one that arrived with it."""
    from scheduler.events import NodeReport

    st = SchedulerState(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    st.handle(NodeReport("n", 0.0, Node("a", 4, 16, 64 * GiB)))
    for i in range(4):
        st.handle(JobArrived(f"w{i}", 0.0, Job(f"w{i}", "m", gpus=4, arrival=0.0)))
    st.handle(JobArrived("s", 0.0, Job("s", "m", gpus=1, arrival=0.0)))
    st.handle(Tick("t", 100.0))
    ctx = st.ledger.context()
    # 5 jobs on 4 GPUs: 0.8 GPU each; the 1-GPU job runs 0.8 of the time, a 4-GPU one 0.2
    assert ctx.share_clock(1) - st.ledger.records["s"].share_start == pytest.approx(80.0)
    assert ctx.share_clock(4) - st.ledger.records["w3"].share_start == pytest.approx(20.0)


def test_share_bound_promotes_a_job_short_of_half_its_equal_share_until_it_has_it():
    g = Gittins(learn=False, share_bound=2.0)
    g.table = GittinsTable(np.random.default_rng(1).pareto(1.0, 5000) * 60 + 1)
    mean = g.table.expected_total(0.0)
    old = _rec("old", arrival=0.0, share_start=0.0)
    young = _rec("young", arrival=10.0, share_start=10.0)
    # a newcomer is owed once an equal share would have run two typical jobs
    assert g.key(old, _ctx(0.0, share_clock=1.5 * mean))[1] == 1
    ctx = _ctx(0.0, share_clock=2.5 * mean)
    assert ShareBound(2.0).owed(old, ctx, mean) and g.key(old, ctx)[1] == 0
    assert g.key(old, ctx) < g.key(young, ctx)  # owed ones go first, oldest first
    # a job that ran 10x the mean is owed only when the clock passed twice that
    ran = _rec("ran", arrival=0.0, service=10 * mean, share_start=0.0)
    assert g.key(ran, _ctx(0.0, share_clock=15 * mean))[1] == 1
    assert g.key(ran, _ctx(0.0, share_clock=25 * mean))[1] == 0
    # promoted, it keeps the GPUs until it has run its whole equal share, then goes back to its index
    running = _rec("ran", arrival=0.0, service=13 * mean, share_start=0.0, running=True)
    assert g.key(running, _ctx(0.0, share_clock=25 * mean))[1] == 0
    running.job.attained_service = 26 * mean
    assert g.key(running, _ctx(0.0, share_clock=25.5 * mean))[1] == 1
    with pytest.raises(ValueError):
        Gittins(boost=10.0, share_bound=2.0)


def test_preempt_margin_keeps_a_running_job_against_a_slightly_better_index():
    g = Gittins(learn=False, preempt_margin=2.0)
    g.table = GittinsTable(np.random.default_rng(1).pareto(1.0, 5000) * 60 + 1)
    ctx = _ctx(0.0, 0.0)
    runner = _rec("run", arrival=0.0, service=1000.0, running=True)
    waiter = _rec("wait", arrival=0.0, service=600.0)
    plain = Gittins(learn=False)
    plain.table = g.table
    r_run, r_wait = g.table(1000.0), g.table(600.0)
    assert r_run < r_wait < 2 * r_run  # the waiting job's index is better, but not twice as good
    assert plain.key(waiter, ctx) < plain.key(runner, ctx)
    assert g.key(runner, ctx) < g.key(waiter, ctx)


def test_gittins_told_a_distribution_ranks_by_it_and_refuses_a_bad_one():
    """``samples`` (the benchmark's known-distribution reference) replaces the Philly prior: under run
    times that all end at 100 s the job nearer its end ranks first; under a decreasing hazard (Pareto)
    the fresh one does."""
    ctx = _ctx(0.0, 0.0)
    fresh, half = _rec("fresh"), _rec("half", service=50.0)
    told = Gittins(learn=False, samples=[100.0] * 50)
    assert told.key(half, ctx) < told.key(fresh, ctx)
    heavy = Gittins(learn=False, samples=list(np.random.default_rng(1).pareto(1.0, 5000) * 10 + 1))
    assert heavy.key(fresh, ctx) < heavy.key(half, ctx)
    for bad in ([], [100.0, -1.0], [float("nan")], [[1.0, 2.0]]):
        with pytest.raises(ValueError, match="samples"):
            Gittins(samples=bad)
    with pytest.raises(ProfileError, match="samples"):
        _prof(samples=[0.0])


def _prof(**order):
    return parse_profile({"name": "t", "order": {"plugin": "gittins", "args": {"learn": False, **order}},
                          "score": [{"plugin": "consolidate"}]})


def test_max_preemptions_lets_a_job_run_to_its_end_and_is_checked():
    prof = parse_profile({"name": "t", "order": {"plugin": "las"}, "placement": {"max_preemptions": 1}})
    assert prof.max_preemptions == 1
    st = SchedulerState(prof, [Node("n0", 1, 4, 64 * GiB)], rng=random.Random(0))
    st.handle(JobArrived("a", 0.0, Job("a", "m", arrival=0.0)))
    st.handle(JobArrived("b", 1.0, Job("b", "m", arrival=1.0)))
    preempts = []
    for k in range(1, 40):  # LAS would swap the two every round: each is preempted once, then runs on
        preempts += [d.job for d in st.handle(Tick(f"t{k}", 360.0 * k)) if isinstance(d, Preempt)]
    assert sorted(preempts) == ["a", "b"]
    assert st.records["a"].preemptions == 1 and st.records["b"].preemptions == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(ProfileError):
            parse_profile({"name": "t", "order": {"plugin": "las"}, "placement": {"max_preemptions": bad}})


def test_a_bound_pod_holds_its_gpus_in_the_preemptive_admission():
    from scheduler.events import JobBound

    st = SchedulerState(_prof(), [Node("n0", 2, 8, 64 * GiB)], rng=random.Random(0))
    st.handle(JobBound("bind", 0.0, Job("pod", "m", gpus=1), "n0"))
    st.handle(JobArrived("a", 1.0, Job("a", "m", gpus=1, arrival=1.0)))
    st.handle(JobArrived("b", 2.0, Job("b", "m", gpus=1, arrival=2.0)))
    out = st.handle(Tick("t", 400.0))
    # one free GPU: one of a and b runs, the other waits; the pod is never preempted
    assert not any(isinstance(d, Preempt) and d.job == "pod" for d in out)
    assert len(st.running) == 2 and "pod" in st.running


def test_the_learned_order_keeps_all_anonymous_owners_identical_to_no_fair_share():
    """Fair share with everyone anonymous gives the same decisions as the order alone (dlshare's order)."""
    import dataclasses

    from scheduler import load_profile

    on = load_profile("dlshare")
    off = dataclasses.replace(on, fairshare=dataclasses.replace(on.fairshare, enabled=False))
    runs = []
    for prof in (on, off):
        st = SchedulerState(prof, [Node(f"n{i}", 2, 8, 64 * GiB) for i in range(2)], rng=random.Random(3))
        rng = random.Random(7)
        out, t = [], 0.0
        live: list[str] = []
        for k in range(120):
            t += rng.expovariate(1 / 300.0)
            if live and rng.random() < 0.4:
                jid = live.pop(rng.randrange(len(live)))
                if st.records[jid].job.state.value == "running":
                    out += st.handle(JobFinished(f"f{k}", t, jid))
                    continue
            jid = f"j{k}"
            out += st.handle(JobArrived(f"a{k}", t, Job(jid, "ResNet-18", 32, gpus=rng.choice([1, 1, 2]), arrival=t)))
            live.append(jid)
            out += st.handle(Tick(f"t{k}", t + 1.0))
            t += 1.0
        runs.append([(type(d).__name__, getattr(d, "job", "")) for d in out if isinstance(d, (Place, Preempt))])
    assert runs[0] == runs[1] and len(runs[0]) > 50
