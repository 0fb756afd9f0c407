"""Issue 23: clusters of several GPU generations (typed nodes, the simulator's per-type speeds,
gangs on one generation, the gpu_type score and filter)."""

import random

import pytest

from scheduler import Job, JobArrived, Node, NodeReport, SchedulerState
from scheduler.codec import event_from_dict, event_to_dict
from scheduler.events import Place
from scheduler.framework import Candidate, Context, NodeState
from scheduler.model import GiB, JobRecord, gpu_type_of
from scheduler.plugins.placement import GpuType, GpuTypeFloor
from scheduler.predictors import Predictors
from scheduler.predictors.gputypes import TypeSpeeds
from scheduler.profile import parse_profile
from scheduler.sim import Cluster, GroundTruth, simulate
from scheduler.trace import TraceJob

# A made-up table in Gavel's layout: "fast" gains 4x from a V100 over a K80, "even" only 1.25x.
KEYS = {"fast": "('fast', 1)", "even": "('even', 1)", "wide": "('wide', 8)"}
THR = {"v100": {KEYS["fast"]: {"null": 4.0}, KEYS["even"]: {"null": 1.0}, KEYS["wide"]: {"null": 2.0}},
       "k80": {KEYS["fast"]: {"null": 1.0}, KEYS["even"]: {"null": 0.8}, KEYS["wide"]: {"null": 0.5}},
       "v100_unconsolidated": {}}


@pytest.mark.parametrize("name,want", [("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA-A100-SXM4-40GB", "a100"),
                                       ("Tesla K80", "k80"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("GeForce RTX 3090", "rtx3090"), ("Simulated V100", "v100"), ("p100", "p100"),
                                       ("sim", ""), ("", "")])
def test_gpu_type_of_names_the_generation(name, want):
    assert gpu_type_of(name) == want


def test_typed_cluster_groups_parse_and_build_typed_nodes():
    cl = Cluster.parse("2x4@v100,1x8:32:900@K80")
    assert str(cl) == "2x4@v100,1x8@k80" and cl.total_gpus == 16 and cl.total_cores == 2 * 12 + 32
    ns = cl.make_nodes()
    assert [(n.id, n.gpus, n.gpu_type) for n in ns] == [("n00000", 4, "v100"), ("n00001", 4, "v100"),
                                                           ("n00002", 8, "k80")]
    assert str(Cluster.parse("16x4")) == "16x4" and Cluster.parse("16x4").make_nodes()[0].gpu_type == ""
    for bad in ("2x4@v 100", "2x4,,1x4", "2x4@" + "x" * 80, "0x4@v100"):
        with pytest.raises(ValueError):
            Cluster.parse(bad)
    with pytest.raises(ValueError):
        Node("n", 1, 1, 1, gpu_type="x" * 100)


def test_ground_truth_runs_a_job_at_its_speed_on_each_generation():
    truth = GroundTruth(THR["v100"], None, by_type=THR)
    fast, even = Job("a", "fast"), Job("b", "even")
    assert truth.type_factor(fast, "k80") == pytest.approx(0.25) and truth.type_factor(even, "k80") == 0.8
    assert truth.type_factor(fast, "v100") == 1.0 and truth.type_factor(fast, "") == 1.0
    assert truth.type_factor(Job("c", "unknown"), "k80") == 1.0
    # in the simulator: a 1 h (V100) job alone on a K80 takes 4 h
    tr = [TraceJob("j", 0.0, "fast", 0, 1, 0, 3600.0)]
    r = simulate(tr, Cluster.parse("1x1@k80"), "fifo", truth=truth, predictors=Predictors(), restart_overhead_s=0.0)
    assert r.jct_s[0] == pytest.approx(4 * 3600.0)


def _typed_state(profile, speeds=None):
    preds = Predictors(type_speeds=TypeSpeeds(speeds or {k: {kk: v["null"] for kk, v in t.items()}
                                                         for k, t in THR.items() if t}))
    nodes = [Node("v0", 4, 16, 64 * GiB, gpu_type="v100"), Node("k0", 4, 16, 64 * GiB, gpu_type="k80"),
             Node("k1", 4, 16, 64 * GiB, gpu_type="k80")]
    return SchedulerState(profile, nodes, predictors=preds, rng=random.Random(0))


def test_a_gang_spans_nodes_of_one_generation_only():
    st = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}, "score": [{"plugin": "consolidate"}]}))
    st.handle(JobArrived("s", 0.0, Job("small", "even", gpus=1)))  # leaves 3 V100s + 8 K80s free
    out = st.handle(JobArrived("w", 1.0, Job("wide", "wide", gpus=8)))
    place = next(d for d in out if isinstance(d, Place) and d.job == "wide")
    assert sorted(sh.node for sh in place.shards) == ["k0", "k1"]  # 3 V100s + 5 K80s would be a mixed gang
    st.handle(JobArrived("w2", 2.0, Job("wide2", "wide", gpus=4)))
    st2 = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    st2.handle(JobArrived("a", 0.0, Job("k", "even", gpus=4)))  # on some node; 8 GPUs left across types or one type
    free_types = {ns.node.gpu_type for ns in st2.nodes.values() if ns.free_gpus == 4}
    out = st2.handle(JobArrived("w", 1.0, Job("wide", "wide", gpus=8)))
    placed = [d for d in out if isinstance(d, Place)]
    assert bool(placed) == (free_types == {"k80"})


def _ctx(st):
    return st.context()


def test_gpu_type_score_gives_the_fast_gpus_to_the_job_that_gains_most():
    st = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    for k, model in enumerate(("fast", "even")):
        st.ledger.enqueue(JobRecord(Job(f"q{k}", model)))
    ctx = _ctx(st)
    score = GpuType()
    v, k = Candidate(st.nodes["v0"], ()), Candidate(st.nodes["k0"], ())
    fast, even = JobRecord(Job("x", "fast")), JobRecord(Job("y", "even"))
    assert score.score(fast, v, ctx) > score.score(fast, k, ctx)  # 4x on a V100: take it
    assert score.score(even, k, ctx) > score.score(even, v, ctx)  # 1.25x: leave it, the K80 costs it little
    untyped = NodeState.fresh(Node("u", 4, 16, 64 * GiB))
    assert score.score(fast, Candidate(untyped, ()), ctx) == 1.0


def test_gpu_type_filter_waits_for_a_fast_gpu_unless_the_backlog_is_deep():
    st = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    floor = GpuTypeFloor()
    fast, even = JobRecord(Job("x", "fast")), JobRecord(Job("y", "even"))
    k = Candidate(st.nodes["k0"], ())
    # a V100 is free: the K80 is refused to both (floor 1)
    assert floor.filter(fast, k, _ctx(st)) is not None and floor.filter(even, k, _ctx(st)) is not None
    assert floor.filter(fast, Candidate(st.nodes["v0"], ()), _ctx(st)) is None
    st.handle(JobArrived("busy", 0.0, Job("busy", "even", gpus=4)))  # the V100s are taken (fifo: first node)
    assert st.nodes["v0"].free_gpus == 0
    # no V100 free, nothing waiting: wait for it unless the K80 costs less than half the speed
    assert floor.filter(fast, k, _ctx(st)) is not None  # 0.25 < 1/2
    assert floor.filter(even, k, _ctx(st)) is None  # 0.8 >= 1/2
    for i in range(40):  # 40 GPUs asked for on 12: about three waves of work ahead
        st.ledger.enqueue(JobRecord(Job(f"q{i}", "even")))
    st.ledger.now = 1.0
    assert floor.filter(fast, k, _ctx(st)) is None  # 1 / (1 + 1 + 40/12) = 0.19 <= 0.25
    assert GpuTypeFloor(min_speed=0.5).filter(fast, k, _ctx(st)) is not None
    with pytest.raises(ValueError):
        GpuTypeFloor(min_speed=1.5)


def test_the_equal_share_clock_counts_a_slow_gpu_for_what_it_is_worth():
    st = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    worth = st.predictors.gpu_worth("k80")
    assert 0 < worth < 1 and st.predictors.gpu_worth("") == 1.0
    assert st.ledger.share_clock.capacity == pytest.approx(4 + 8 * worth)
    # a node that reports another generation changes the capacity; the codec carries the type
    ev = NodeReport("r", 1.0, Node("k1", 4, 16, 64 * GiB, gpu_type="v100"))
    assert event_from_dict(event_to_dict(ev)) == ev
    st.handle(ev)
    assert st.nodes["k1"].node.gpu_type == "v100"
    assert st.ledger.share_clock.capacity == pytest.approx(8 + 4 * worth)


def test_dlshare_on_an_untyped_cluster_ignores_its_type_plugins():
    """The gpu_type filter and score change nothing where no node has a type."""
    import dataclasses

    from bench.sched_mixed import blind
    from scheduler import load_profile

    tr = [TraceJob(str(i), 600.0 * i, m, 32, g, 0, 3600.0 * (1 + i % 4))
          for i, (m, g) in enumerate([("ResNet-18", 1), ("Transformer", 2), ("LM", 1), ("ResNet-50", 4)] * 5)]
    full = load_profile("dlshare")
    assert {f.plugin for f in blind(full).filters} == {"gpu_memory", "colocation_gain"}
    a = simulate(tr, Cluster.parse("2x4"), full, predictors="oracle").metrics()
    b = simulate(tr, Cluster.parse("2x4"), dataclasses.replace(blind(full), name=full.name), predictors="oracle").metrics()
    assert a["avg_jct_h"] == b["avg_jct_h"] and a["preemptions"] == b["preemptions"]


@pytest.mark.parametrize("ahead", [True, False])
def test_the_floor_counts_the_work_queued_ahead_of_the_job(ahead):
    """With ``ahead``, the head of the queue waits for the fast generation and jobs far back take the
    slow one; counting every waiting job instead, the head takes the slow GPU too."""
    prof = parse_profile({"name": "t", "order": {"plugin": "fifo"},
                          "filter": [{"plugin": "gpu_type", "args": {"ahead": ahead}}]})
    st = _typed_state(prof)
    st.handle(JobArrived("busy", 0.0, Job("busy", "even", gpus=4)))  # the V100s are taken
    assert st.nodes["v0"].free_gpus == 0
    for i in range(60):  # "fast" runs at 0.25 of its V100 speed on a K80; each job a class of its own
        st.handle(JobArrived(f"a{i}", 1.0 + i, Job(f"f{i:02d}", "fast", memory_bytes=(i + 1) << 20)))
    on_k80 = sorted(jid for jid, r in st.ledger.records.items() if r.shards and r.job.model == "fast")
    assert len(on_k80) == 8  # the K80s are full
    if ahead:
        # 1 / (1 + ahead / 12 + 1) <= 0.25 once 24 GPUs' worth of jobs wait ahead
        assert all(int(j[1:]) >= 24 for j in on_k80) and st.ledger.records["f00"].shards == ()
    else:
        assert "f00" in on_k80


def test_twins_wait_with_the_first_of_their_class():
    """The core's equivalence classes: once the first of a class is refused, its twins behind it are
    not tried in that pass, so with ``ahead`` a class of twins waits for the fast generation together."""
    prof = parse_profile({"name": "t", "order": {"plugin": "fifo"},
                          "filter": [{"plugin": "gpu_type", "args": {"ahead": True}}]})
    st = _typed_state(prof)
    st.handle(JobArrived("busy", 0.0, Job("busy", "even", gpus=4)))
    for i in range(60):
        st.handle(JobArrived(f"a{i}", 1.0 + i, Job(f"f{i:02d}", "fast")))
    assert not any(r.shards for r in st.ledger.records.values() if r.job.model == "fast")
    assert st.nodes["k0"].free_gpus == st.nodes["k1"].free_gpus == 4


def test_the_floor_reads_the_queue_ahead_only_when_asked():
    st = _typed_state(parse_profile({"name": "t", "order": {"plugin": "fifo"}}))
    st.handle(JobArrived("busy", 0.0, Job("busy", "even", gpus=4)))
    for i in range(40):
        st.ledger.enqueue(JobRecord(Job(f"q{i}", "even")))
    st.ledger.now = 1.0
    fast, k = JobRecord(Job("x", "fast")), Candidate(st.nodes["k0"], ())
    ctx = _ctx(st)
    ctx.ahead_gpus = 0  # at the head: floor 1/2, the K80's 0.25 is refused
    assert GpuTypeFloor(ahead=True).filter(fast, k, ctx) is not None
    assert GpuTypeFloor().filter(fast, k, ctx) is None  # the whole backlog: floor 0.19
    ctx.ahead_gpus = 40
    assert GpuTypeFloor(ahead=True).filter(fast, k, ctx) is None
    ctx.ahead_gpus = None  # not known: every waiting job counts
    assert GpuTypeFloor(ahead=True).filter(fast, k, ctx) is None
