"""Lent memory in the scheduler core: donors' lendable bytes are a cluster resource the core
promises to memory-short jobs (the ``lent`` allocation plugin), takes back when a donor reclaims or
is lost (the job keeps running), and gives to others when a borrower leaves."""

import random

import pytest

from scheduler import (
    Allocate, DonorReclaimed, Job, JobArrived, JobFinished, Node, NodeLost, Place, Preempt, Release, SchedulerError,
    SchedulerState, load_profile,
)
from scheduler import remote_memory as rm
from scheduler.donors import DonorPool
from scheduler.predictors import Predictors
from scheduler.predictors.sensitivity import SensitivityModel
from scheduler.sim import Cluster, simulate
from scheduler.trace import TraceJob

GB = 10 ** 9

# One memory-sensitive image model in Synergy's table shape: memory levels per GPU 20.83 and 62.5 GB.
SENS = {"img_1": {"model": "img", "num_gpus": 1, "batch_size": 512, "iter_time_s": 0.6,
                  "throughput": [[0.1, 0.3], [0.1, 0.66], [0.1, 1.0]]}}


def predictors() -> Predictors:
    return Predictors(sensitivity=SensitivityModel([1, 2, 3], [20.83, 62.5], SENS))


def state(profile: str = "dlshare", gpu_nodes: int = 1, lend_gb: tuple[int, ...] = (100,)) -> SchedulerState:
    """1-GPU nodes with 3 cores and 31.25 GB (half the 62.5 GB level), and CPU-only donors."""
    nodes = [Node(f"g{i}", 1, 3, int(31.25 * GB)) for i in range(gpu_nodes)]
    nodes += [Node(f"prep{i}", 0, 8, 500 * GB, lendable_bytes=n * GB) for i, n in enumerate(lend_gb)]
    return SchedulerState(load_profile(profile), nodes, predictors=predictors(), rng=random.Random(0))


def allocs(out, job):
    return [d for d in out if isinstance(d, Allocate) and d.job == job]


def test_a_memory_short_job_borrows_from_a_donor_and_runs_at_the_level_it_reaches():
    st = state()
    out = st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    assert any(isinstance(d, Place) for d in out)
    a = allocs(out, "j")[-1]
    assert a.remote_memory_bytes > 0 and a.cpus == 3
    sens = st.predictors.sensitivity
    assert sens.speed("img", 1, a.cpus, a.memory_bytes) == pytest.approx(0.1)  # local alone: the bottom level
    assert sens.speed("img", 1, a.cpus, a.memory_bytes + a.remote_memory_bytes) == pytest.approx(1.0)
    pool = st.ledger.pool
    assert pool.held(("j", "g0")) == a.remote_memory_bytes == pool.promised_on("prep0")
    assert a.memory_bytes + a.remote_memory_bytes <= 63 * GB  # no more than the level needs


def test_without_donors_the_lent_plugin_decides_exactly_as_synergy():
    runs = []
    for prof in ("synergy", "dlshare"):
        st = state(prof, gpu_nodes=2, lend_gb=())
        out = st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)), JobArrived("b", 0.0, Job("k", "img", gpus=1)))
        out += st.handle(JobFinished("f", 5.0, "j"))
        runs.append([d for d in out if isinstance(d, Allocate)])
    assert runs[0] == runs[1] and runs[0]
    assert all(d.remote_memory_bytes == 0 for d in runs[0])


def test_synergy_never_borrows_even_when_donors_lend():
    st = state("synergy")
    out = st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    assert all(d.remote_memory_bytes == 0 for d in allocs(out, "j"))
    assert st.ledger.pool.promised_on("prep0") == 0


def test_a_reclaim_takes_lent_bytes_back_and_the_job_keeps_running():
    st = state()
    st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    held = st.ledger.pool.held(("j", "g0"))
    out = st.handle(DonorReclaimed("r", 10.0, "prep0", 90 * GB))  # 10 GB left to lend
    assert not [d for d in out if isinstance(d, (Preempt, Release))]
    a = allocs(out, "j")[-1]
    assert a.remote_memory_bytes < held
    assert st.ledger.pool.promised_on("prep0") <= 10 * GB
    assert st.ledger.pool.reclaimed_bytes > 0
    assert st.records["j"].job.state.value == "running"


def test_a_reclaim_is_made_good_from_another_donor_when_one_has_room():
    st = state(lend_gb=(100, 100))
    st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    (donor, n), = st.ledger.pool.donors_of(("j", "g0")).items()
    out = st.handle(DonorReclaimed("r", 10.0, donor, 100 * GB))
    assert allocs(out, "j") == [] or allocs(out, "j")[-1].remote_memory_bytes == n  # topped up elsewhere
    assert st.ledger.pool.held(("j", "g0")) == n
    assert donor not in st.ledger.pool.donors_of(("j", "g0"))


def test_a_lost_donor_takes_everything_it_lent_back_and_nobody_is_stopped():
    st = state()
    st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    out = st.handle(NodeLost("l", 10.0, "prep0"))
    assert not [d for d in out if isinstance(d, (Preempt, Release))]
    assert allocs(out, "j")[-1].remote_memory_bytes == 0
    assert st.ledger.pool.held(("j", "g0")) == 0 and st.ledger.pool.stats()["capacity_bytes"] == 0


def test_bytes_a_finished_job_gave_back_go_to_a_job_that_could_not_borrow():
    st = state(gpu_nodes=2, lend_gb=(50,))  # room for one borrower at the 62.5 GB level
    out = st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)), JobArrived("b", 0.0, Job("k", "img", gpus=1)))
    lent = {d.job: d.remote_memory_bytes for d in out if isinstance(d, Allocate)}
    borrower = max(lent, key=lent.get)
    other = "k" if borrower == "j" else "j"
    assert lent[borrower] > 0 and lent[other] == 0
    out = st.handle(JobFinished("f", 5.0, borrower))
    assert allocs(out, other)[-1].remote_memory_bytes > 0


def test_bad_reclaims_are_refused_and_change_nothing():
    st = state()
    st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    before = st.ledger.pool.stats()
    with pytest.raises(SchedulerError, match="unknown donor"):
        st.handle(DonorReclaimed("r", 1.0, "nope", GB))
    with pytest.raises(SchedulerError, match=">= 0"):
        st.handle(DonorReclaimed("r2", 1.0, "prep0", -1))
    assert st.ledger.pool.stats() == before
    out, refused = st.handle_batch([DonorReclaimed("r3", 2.0, "prep0", -5)])
    assert refused and refused[0][0] == "r3"


def test_borrowing_stops_where_the_donor_cannot_carry_the_reads():
    st = state()
    st.ledger.pool = DonorPool(rm.RemoteLink(donor_bytes_per_s=1e6))  # 1 MB/s: far below the job's input rate
    st.ledger.pool.set_capacity("prep0", 100 * GB)
    out = st.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1)))
    assert all(d.remote_memory_bytes == 0 for d in allocs(out, "j"))


def test_efficiency_model():
    assert rm.efficiency(0.0, 1.0) == 1.0
    assert rm.efficiency(200.0, 100.0) == 0.5
    assert rm.reserved_shares({"a": 10.0, "b": 80.0, "c": 100.0}, 110.0) == {"a": 10.0, "b": 80.0, "c": 20.0}
    assert rm.remote_demand(100.0, 30.0, 10.0) == pytest.approx(25.0)
    link = rm.RemoteLink()
    assert 0 < link.stream_bytes_per_s(108e3, 1) < link.read_bytes_per_s
    with pytest.raises(ValueError):
        rm.RemoteLink(read_bytes_per_s=0)
    rate = rm.input_rate(predictors().sensitivity, "img", 1, 1.0)
    assert rate == pytest.approx(512 * 108e3 / 0.6)


def test_the_pool_takes_back_newest_promises_first():
    pool = DonorPool()
    pool.set_capacity("d", 100)
    assert pool.grant(("a", "n"), 60) == 60 and pool.grant(("b", "n"), 60) == 40
    assert pool.set_capacity("d", 70) == [("b", "n")]
    assert pool.held(("b", "n")) == 10 and pool.held(("a", "n")) == 60 and pool.reclaimed_bytes == 30
    assert pool.set_capacity("d", 0) == [("b", "n"), ("a", "n")] and pool.total_free() == 0
    with pytest.raises(ValueError):
        pool.set_capacity("d", -1)


def test_the_simulator_runs_memory_short_jobs_faster_with_lent_memory_and_survives_a_reclaim():
    trace = [TraceJob(str(i), 60.0 * i, "img", 512, 1, 0, 3600.0) for i in range(6)]
    cl = Cluster.parse("2x2:6:62.5")  # 31.25 GB per GPU: half the level the model needs
    donors = [Node("prep0", 0, 8, 500 * GB, lendable_bytes=200 * GB)]
    from scheduler.sim import GroundTruth

    truth = GroundTruth({}, predictors().sensitivity)
    kw = {"predictors": predictors(), "truth": truth}
    local = simulate(trace, cl, "synergy", **kw).metrics()
    lent = simulate(trace, cl, "dlshare", donors=donors, **kw).metrics()
    reclaim = simulate(trace, cl, "dlshare", donors=donors, reclaims=[(1800.0, "prep0", 150 * GB)], **kw).metrics()
    assert lent["failed"] == reclaim["failed"] == local["failed"] == 0
    assert lent["avg_jct_h"] < 0.5 * local["avg_jct_h"]
    assert lent["avg_jct_h"] < reclaim["avg_jct_h"] <= local["avg_jct_h"]


def test_a_job_that_asks_for_lent_memory_waits_for_it_and_bad_asks_are_rejected():
    st = state(gpu_nodes=2, lend_gb=(50,))
    out = st.handle(JobArrived("a", 0.0, Job("j", "other", gpus=1, remote_memory_bytes=40 * GB)))
    assert allocs(out, "j")[-1].remote_memory_bytes == 40 * GB  # granted although the model has no profile
    out = st.handle(JobArrived("b", 1.0, Job("k", "other", gpus=1, remote_memory_bytes=20 * GB)))
    assert not [d for d in out if isinstance(d, Place)]  # 10 GB free: it waits
    assert "lent memory" in st.explain(Job("k", "other", gpus=1, remote_memory_bytes=20 * GB))["g1"]
    out = st.handle(JobFinished("f", 2.0, "j"))
    assert [d.job for d in out if isinstance(d, Place)] == ["k"]
    assert allocs(out, "k")[-1].remote_memory_bytes == 20 * GB
    out = st.handle(JobArrived("c", 3.0, Job("big", "other", gpus=1, remote_memory_bytes=51 * GB)))
    assert any(d.job == "big" and "donors lend at most" in d.reason for d in out if hasattr(d, "reason"))
    syn = state("synergy")
    out = syn.handle(JobArrived("a", 0.0, Job("j", "img", gpus=1, remote_memory_bytes=GB)))
    assert any("does not hand lent memory out" in getattr(d, "reason", "") for d in out)
    with pytest.raises(ValueError, match="remote_memory_bytes"):
        Job("j", "img", gpus=1, remote_memory_bytes=-1)
