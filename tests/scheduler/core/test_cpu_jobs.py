"""CPU-only (data-preparation) jobs are core jobs: ordered with the GPU jobs, placed by the
profile's filters and scores where their cores and memory fit, and given what they asked for by
the allocation plugin, which splits among GPU jobs only what they leave."""

import pytest

from scheduler import (
    Allocate, Job, JobArrived, JobCancelled, JobFinished, JobState, Node, NodeLost, NodeReport, Place, Reject,
    Release, SchedulerState, Tick,
)
from scheduler.model import GiB


def cpu(jid: str, cpus: float = 4.0, mem_gib: int = 8, priority: int = 0) -> Job:
    return Job(jid, "prep", gpus=0, cpus=cpus, memory_bytes=mem_gib * GiB, priority=priority)


def gpu(jid: str, gpus: int = 1) -> Job:
    return Job(jid, "ResNet-18", 32, gpus=gpus)


def of(kind, ds):
    return [d for d in ds if isinstance(d, kind)]


def test_a_cpu_only_job_must_ask_for_cores():
    with pytest.raises(ValueError, match="cpus > 0"):
        Job("x", "prep", gpus=0)
    with pytest.raises(ValueError, match="gpus must be >= 0"):
        Job("x", "prep", gpus=-1, cpus=1.0)
    assert cpu("x").cpu_only and not gpu("y").cpu_only


@pytest.mark.parametrize("profile", ["fifo", "dlshare", "las", "tiresias", "synergy"])
def test_cpu_jobs_are_placed_and_get_exactly_their_request(profile):
    st = SchedulerState(profile, [Node("g0", 4, 16, 64 * GiB)])
    out = st.handle(JobArrived("a", 0.0, cpu("c1", cpus=4.0, mem_gib=8)))
    [p] = of(Place, out)
    assert p.job == "c1" and p.node == "g0" and p.gpus == () and p.shards[0].gpus == ()
    [a] = [d for d in of(Allocate, out) if d.job == "c1"]
    assert (a.cpus, a.memory_bytes) == (4.0, 8 * GiB)
    assert st.free_gpus == 4  # it took no GPU
    # A GPU job beside it splits what the CPU job leaves: 12 cores and 56 GiB over 4 GPUs.
    out = st.handle(JobArrived("b", 1.0, Job("g1", "unknown-model", gpus=2)))
    [a] = [d for d in of(Allocate, out) if d.job == "g1"]
    assert a.cpus == pytest.approx(6.0) and a.memory_bytes == pytest.approx(28 * GiB, rel=1e-6)
    assert st.records["c1"].allocation["g0"].cpus == 4.0  # unchanged by the newcomer


def test_cpu_jobs_wait_where_cores_run_out_and_start_when_they_free():
    st = SchedulerState("fifo", [Node("c0", 0, 8, 32 * GiB)])
    assert of(Place, st.handle(JobArrived("1", 0.0, cpu("a", cpus=6.0))))
    assert not of(Place, st.handle(JobArrived("2", 1.0, cpu("b", cpus=4.0))))  # 2 cores left
    assert of(Place, st.handle(JobArrived("3", 2.0, cpu("c", cpus=2.0))))  # fits beside a
    out = st.handle(JobFinished("4", 5.0, "a"))
    assert [p.job for p in of(Place, out)] == ["b"]
    [rel] = of(Release, out)
    assert rel.job == "a" and rel.nodes == ("c0",) and rel.state is JobState.DONE and not rel.stop
    assert st.records["b"].queueing_delay == pytest.approx(4.0)


def test_a_gpu_job_blocked_on_gpus_does_not_block_cpu_jobs_even_without_backfill(tmp_path):
    strict = tmp_path / "strict.toml"
    strict.write_text('name="strict"\n[order]\nplugin="fifo"\n[placement]\nbackfill=false\n')
    st = SchedulerState(str(strict), [Node("g0", 2, 16, 64 * GiB)])
    st.handle(JobArrived("1", 0.0, gpu("a", 2)))
    assert not of(Place, st.handle(JobArrived("2", 1.0, gpu("b", 1))))  # no free GPU: waits at the head
    out = st.handle(JobArrived("3", 2.0, cpu("c", cpus=2.0)))
    assert [p.job for p in of(Place, out)] == ["c"]
    assert not of(Place, st.handle(JobArrived("4", 3.0, gpu("d", 1))))  # GPU jobs still queue behind b


def test_cpu_only_nodes_take_cpu_jobs_and_gpu_nodes_are_kept_for_gpu_jobs():
    st = SchedulerState("dlshare", [Node("g0", 4, 16, 64 * GiB), Node("c0", 0, 16, 64 * GiB)])
    [p] = of(Place, st.handle(JobArrived("1", 0.0, cpu("a"))))
    assert p.node == "c0"  # fewest free GPUs first: the CPU node


def test_a_cpu_job_larger_than_every_node_is_rejected():
    st = SchedulerState("fifo", [Node("c0", 0, 8, 32 * GiB)])
    [r] = of(Reject, st.handle(JobArrived("1", 0.0, cpu("a", cpus=9.0))))
    assert "largest node has 8" in r.reason and st.records["a"].job.state is JobState.FAILED


def test_cpu_jobs_on_a_lost_node_are_requeued_and_placed_elsewhere():
    st = SchedulerState("fifo", [Node("c0", 0, 8, 32 * GiB)])
    st.handle(JobArrived("1", 0.0, cpu("a")))
    st.handle(NodeReport("2", 1.0, Node("c1", 0, 8, 32 * GiB)))
    out = st.handle(NodeLost("3", 2.0, "c0"))
    [rel] = of(Release, out)
    assert rel.job == "a" and rel.nodes == () and rel.state is JobState.PREEMPTED and "c0 lost" in rel.reason
    [p] = of(Place, out)
    assert p.job == "a" and p.node == "c1" and p.resumed


def test_preemptive_orders_never_preempt_or_wake_for_cpu_jobs():
    st = SchedulerState("las", [Node("g0", 1, 16, 64 * GiB)])
    st.handle(JobArrived("1", 0.0, cpu("c")))
    st.handle(JobArrived("2", 0.0, gpu("a")))
    st.handle(JobArrived("3", 1.0, gpu("b")))
    out = st.handle(Tick("4", 400.0))
    assert {d.job for d in out if type(d).__name__ == "Preempt"} == {"a"}
    assert st.records["c"].job.state is JobState.RUNNING and st.records["c"].preemptions == 0


def test_cancelling_a_running_cpu_job_releases_it_with_a_stop():
    st = SchedulerState("fifo", [Node("c0", 0, 8, 32 * GiB)])
    st.handle(JobArrived("1", 0.0, cpu("a")))
    [rel] = of(Release, st.handle(JobCancelled("2", 1.0, "a", "by user")))
    assert rel.stop and rel.state is JobState.FAILED and rel.nodes == ("c0",) and rel.reason == "by user"
    assert st.nodes["c0"].reserved_cpus == 0 and st.nodes["c0"].reserved_memory == 0
