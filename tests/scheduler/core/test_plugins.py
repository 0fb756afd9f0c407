"""Each plugin on its own, through the framework's interfaces."""

import random

import numpy as np
import pytest

from scheduler import Job, JobArrived, Node, SchedulerState, load_profile, plugins
from scheduler import JobFinished, framework
from scheduler.framework import Candidate, Context, NodeState, QueueSort, register
from scheduler.profile import PluginSpec, Profile
from scheduler.model import GiB, JobRecord
from scheduler.plugins.allocation import Proportional, SynergyTune
from scheduler.plugins.ordering import Fifo, Gittins, GittinsTable, Las, Srtf, Tiresias
from scheduler.plugins.placement import (
    ColocationGain, Consolidate, GpuMemory, Interference, RandomPack, Spread, UtilisationCap,
)
from scheduler.predictors import Predictors
from scheduler.predictors.sensitivity import SensitivityModel


def rec(jid, gpus=1, arrival=0.0, service=0.0, duration=None, model="m", bs=0, prio=0, run_since=None):
    r = JobRecord(Job(jid, model, bs, gpus=gpus, arrival=arrival, attained_service=service, duration=duration,
                      priority=prio))
    r.run_since = run_since
    return r


def ctx(now=0.0, records=None, predictors=None, seed=0):
    return Context(now=now, records=records or {}, nodes={}, predictors=predictors or Predictors(),
                   rng=random.Random(seed))


def order(plugin, recs, now=0.0):
    c = ctx(now)
    return [r.job.id for r in sorted(recs, key=lambda r: plugin.key(r, c))]


def test_registry_lists_plugins_and_rejects_unknown():
    assert {"fifo", "srtf", "las", "tiresias", "gittins"} <= set(plugins.available("order"))
    with pytest.raises(ValueError, match="unknown score plugin"):
        plugins.build("score", "nope")
    with pytest.raises(ValueError, match="bad arguments"):
        plugins.build("order", "las", {"bogus": 1})


def test_order_plugins_declare_their_hooks_on_queue_sort():
    with pytest.raises(TypeError, match="must subclass scheduler.framework.QueueSort"):
        @register("order", "undeclared")
        class Undeclared:  # noqa: F841 - refused at registration
            preemptive = False

    @register("order", "minimal-test")
    class Minimal(QueueSort):
        def key(self, rec, c):
            return rec.job.arrival

    try:
        m = plugins.build("order", "minimal-test")
        r = rec("a")
        assert not m.preemptive and not m.uniform_wakeup  # the declared defaults
        assert m.next_change(r, ctx()) is None and m.observe_finished(r, ctx()) is None
        st = SchedulerState(Profile("minimal", PluginSpec("minimal-test")), [Node("n", 1, 4, 1 << 30)])
        st.handle(JobArrived("1", 0, Job("a", "m")))
        assert [type(d).__name__ for d in st.handle(JobFinished("2", 5, "a"))] == ["Release"]
        assert st.records["a"].job.state.value == "done"
    finally:
        framework._REGISTRY["order"].pop("minimal-test", None)


def test_fifo_priority_then_arrival():
    assert order(Fifo(), [rec("b", arrival=2), rec("a", arrival=1), rec("p", arrival=3, prio=1)]) == ["p", "a", "b"]


def test_gittins_starvation_guard_promotes_long_waiters():
    g = Gittins(learn=False, starve_factor=2.0)
    g.table = GittinsTable(np.random.default_rng(1).pareto(1.0, 5000) * 60 + 1)
    starving = rec("starving", service=100.0)
    starving.queued_since = 0.0
    fresh = rec("fresh", service=1.0)
    fresh.queued_since = 250.0
    assert order(g, [starving, fresh], now=500) == ["fresh", "starving"]  # waited 500 < 2 x max(100, 360)
    assert order(g, [starving, fresh], now=800) == ["starving", "fresh"]  # waited 800 > 720; fresh only 550


def test_srtf_uses_remaining_oracle_time():
    rs = [rec("long", duration=100), rec("short", duration=50), rec("half", duration=80, service=40)]
    assert order(Srtf(), rs) == ["half", "short", "long"]  # 40, 50, 100 s left


def test_las_counts_running_service_lazily():
    running = rec("run", gpus=2, run_since=0.0)
    waiting = rec("wait", service=100.0)
    assert order(Las(), [running, waiting], now=10) == ["run", "wait"]  # 20 < 100 GPU-s
    assert order(Las(), [running, waiting], now=60) == ["wait", "run"]  # 120 > 100


def test_tiresias_thresholds_scale_with_finished_work():
    t = Tiresias(quantiles=[0.5], min_samples=5)
    first = list(t.thresholds)
    for i in range(10):
        r = rec(f"f{i}", service=1e6 * (i + 1))
        t.observe_finished(r, ctx())
    assert t.thresholds[0] > first[0] * 10  # multi-day jobs move the boundary up
    fixed = Tiresias(thresholds=[3250, 7200])
    assert fixed.queue_of(100) == 0 and fixed.queue_of(5000) == 1 and fixed.queue_of(10**5) == 2
    # FIFO within a queue, lower queues first
    assert order(fixed, [rec("q1", arrival=0, service=5000), rec("q0", arrival=5, service=10)]) == ["q0", "q1"]


def brute_gittins(samples, a, grid):
    s = np.asarray(samples)
    alive = s[s > a]
    best = 0.0
    for b in grid[grid > a]:
        done = np.sum(alive <= b)
        spent = np.sum(np.minimum(alive, b) - a)
        if spent > 0:
            best = max(best, done / spent)
    return best


def test_gittins_table_matches_brute_force_on_its_grid():
    rng = np.random.default_rng(0)
    samples = rng.pareto(1.2, 3000) * 100 + 1
    tab = GittinsTable(samples, lo=1, hi=1e6, bins=60)
    snapped = tab.grid[np.clip(np.searchsorted(tab.grid, samples), 0, len(tab.grid) - 1)]
    for i in (0, 10, 30):
        a = tab.grid[i]
        assert tab(a) == pytest.approx(brute_gittins(snapped, a, tab.grid), rel=1e-6)


def test_gittins_prefers_young_jobs_under_heavy_tail_and_counts_gpus():
    g = Gittins(learn=False)
    g.table = GittinsTable(np.random.default_rng(1).pareto(1.0, 5000) * 60 + 1)
    assert order(g, [rec("old", service=1e6), rec("young", service=10)]) == ["young", "old"]
    assert order(g, [rec("wide", gpus=8, service=80), rec("narrow", gpus=1, service=10)]) == ["narrow", "wide"]


def _node(gpus=4, residents=None, cores=12, mem=256 * GiB):
    ns = NodeState.fresh(Node("n", gpus, cores, mem))
    for i, r in enumerate(residents or []):
        ns.residents[i] = list(r)
    ns.free_gpus = sum(1 for r in ns.residents if not r)
    return ns


def test_consolidate_spread_random_scores():
    r = rec("x")
    full, empty = _node(residents=[["a"], ["b"], ["c"]]), _node()
    c_full, c_empty = Candidate(full, (3,)), Candidate(empty, (0,))
    assert Consolidate().score(r, c_full, ctx()) > Consolidate().score(r, c_empty, ctx())
    assert Spread().score(r, c_empty, ctx()) > Spread().score(r, c_full, ctx())
    a = [RandomPack().score(r, c_full, ctx(seed=1)) for _ in range(3)]
    b = [RandomPack().score(r, c_full, ctx(seed=1)) for _ in range(3)]
    assert a == b and len(set(a)) == 1


def test_gpu_memory_and_utilisation_cap_filters():
    res = rec("res", model="big")
    res.job.gpu_memory_bytes = 20 * GiB
    new = rec("new", model="small")
    new.job.gpu_memory_bytes = 16 * GiB
    records = {"res": res, "new": new}
    cand = Candidate(_node(residents=[["res"]]), (0,), ("res",))
    assert GpuMemory().filter(new, cand, ctx(records=records)) == "GPU memory"
    new.job.gpu_memory_bytes = 8 * GiB
    assert GpuMemory().filter(new, cand, ctx(records=records)) is None
    p = Predictors(alone_util={"big": (70.0, 30.0), "small": (40.0, 10.0)})
    assert UtilisationCap(cap=100).filter(new, cand, ctx(records=records, predictors=p)) is not None
    assert UtilisationCap(cap=120).filter(new, cand, ctx(records=records, predictors=p)) is None


def test_interference_score_and_gain_filter_use_pair_speeds():
    records = {"r1": rec("r1", model="A"), "r2": rec("r2", model="B"), "new": rec("new", model="N")}
    p = Predictors()
    p.pairs.observe("N", ("A",), 0.9)
    p.pairs.observe("A", ("N",), 0.8)
    p.pairs.observe("N", ("B",), 0.5)
    p.pairs.observe("B", ("N",), 0.4)
    c = ctx(records=records, predictors=p)
    good = Candidate(_node(residents=[["r1"]]), (0,), ("r1",))
    bad = Candidate(_node(residents=[["r2"]]), (0,), ("r2",))
    assert Interference().score(records["new"], good, c) > Interference().score(records["new"], bad, c)
    gate = ColocationGain(min_gain=0.1, min_resident_speed=0.5)
    assert gate.filter(records["new"], good, c) is None
    assert gate.filter(records["new"], bad, c) is not None


def test_proportional_split_sums_to_node():
    ns = _node(residents=[["a"], ["a"], ["b", "c"], []])
    ns.jobs = {"a": 2, "b": 1, "c": 1}
    records = {j: rec(j) for j in "abc"}
    split = Proportional().split(ns, ctx(records=records))
    assert split["a"].cpus == pytest.approx(6) and split["b"].cpus == pytest.approx(1.5)
    assert sum(a.cpus for a in split.values()) == pytest.approx(9)


def test_synergy_tune_beats_proportional_within_capacity():
    sens = SensitivityModel.from_data()
    ns = NodeState.fresh(Node("n", 8, 24, int(500e9)))
    models = ["alexnet", "gnmt", "res18", "lstm", "deepspeech", "mobilenet", "shufflenet", "transformer"]
    records = {}
    for i, m in enumerate(models):
        records[m] = rec(m, model=m)
        ns.residents[i] = [m]
        ns.jobs[m] = 1
    ns.free_gpus = 0
    c = ctx(records=records, predictors=Predictors(sensitivity=sens))
    tuned = SynergyTune().split(ns, c)
    prop = Proportional().split(ns, c)
    assert sum(a.cpus for a in tuned.values()) <= 24 + 1e-9
    assert sum(a.memory_bytes for a in tuned.values()) <= 500e9
    sp = lambda s: [sens.speed(m, 1, s[m].cpus, s[m].memory_bytes) for m in models]  # noqa: E731
    assert all(t >= p - 1e-9 for t, p in zip(sp(tuned), sp(prop)))  # nobody worse than proportional
    assert sum(sp(tuned)) > sum(sp(prop)) * 1.05  # and the total improves


def test_horus_and_iadeep_profiles_share_when_full():
    for prof in ("horus", "iadeep"):
        st = SchedulerState(load_profile(prof), [Node("n", 1, 12, 256 << 30)])
        st.handle(JobArrived("1", 0, Job("a", "A")))
        out = st.handle(JobArrived("2", 0, Job("b", "B")))
        assert st.records["b"].shards, prof
        assert [d.colocated_with for d in out if type(d).__name__ == "Place"] == [("a",)], prof


def test_gittins_per_type_priors_learn_from_finished_jobs():
    g = Gittins(per_type=True, prior_weight=5.0, learn=False)
    short_type = [rec(f"s{i}", model="short", service=600.0) for i in range(30)]
    for r in short_type:
        g.observe_finished(r, ctx())
    long_type = [rec(f"l{i}", model="long", service=5e5) for i in range(30)]
    for r in long_type:
        g.observe_finished(r, ctx())
    # two fresh jobs with equal attained time: the type that finishes fast goes first
    a, b = rec("a", model="long", service=300.0), rec("b", model="short", service=300.0)
    assert order(g, [a, b]) == ["b", "a"]
    assert ("short", 1) in g.types and ("long", 1) in g.types
    # an unseen type falls back on the global prior
    assert g.key(rec("c", model="new", service=300.0), ctx())[1] == -g.table(300.0)
