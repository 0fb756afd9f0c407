"""The core's clock-driven rules, driven by event times and Ticks only: start backoff, vanished
jobs, jobs another engine runs (Kubernetes pods) and their holds; the live shell's batch call."""

import pytest

from scheduler import (
    Allocate, Job, JobArrived, JobBound, JobFinished, JobStarted, JobState, Node, NodeReport, Place,
    PlacementFailed, Release, SchedulerState, Tick, Wakeup, WatchRules,
)
from scheduler.model import GiB

RULES = WatchRules(backoff_s=1.0, backoff_max_s=4.0, vanish_after_s=15.0)


def of(kind, ds):
    return [d for d in ds if isinstance(d, kind)]


def state(rules=RULES, n=1, gpus=1) -> SchedulerState:
    return SchedulerState("fifo", [Node(f"n{i}", gpus, 8, 32 * GiB) for i in range(n)], rules=rules)


def test_a_failed_start_backs_off_doubling_and_a_confirmed_start_resets_it():
    st = state()
    assert of(Place, st.handle(JobArrived("a", 0.0, Job("j", "m"))))
    delays = []
    t = 0.0
    for k in range(4):
        out = st.handle(PlacementFailed(f"f{k}", t, "j", "refused"))
        assert not of(Place, out), "placed again before its backoff"
        [rel] = of(Release, out)
        assert rel.state is JobState.PREEMPTED and rel.nodes == ("n0",) and "refused" in rel.reason
        at = min(w.at for w in of(Wakeup, out))
        delays.append(at - t)
        assert not of(Place, st.handle(Tick(f"early{k}", at - 0.01)))
        out = st.handle(Tick(f"t{k}", at))
        assert [p.job for p in of(Place, out)] == ["j"]
        t = at
    assert delays == pytest.approx([1.0, 2.0, 4.0, 4.0])  # doubling, capped at backoff_max_s
    st.handle(JobStarted("s", t + 0.1, "j", "n0"))
    out = st.handle(PlacementFailed("again", t + 0.2, "j", "refused"))  # the count started over
    assert min(w.at for w in of(Wakeup, out)) == pytest.approx(t + 1.2)


def test_without_rules_a_failed_start_is_placed_again_at_once():
    st = state(rules=None, n=2)
    st.handle(JobArrived("a", 0.0, Job("j", "m")))
    assert [p.job for p in of(Place, st.handle(PlacementFailed("f", 1.0, "j", "oom")))] == ["j"]


def test_a_started_job_missing_from_its_nodes_reports_vanishes_after_the_limit():
    st = state()
    st.handle(JobArrived("a", 0.0, Job("j", "m")))
    node = Node("n0", 1, 8, 32 * GiB)
    # Reports before the node confirmed the start do not count, whatever they list.
    assert not of(Wakeup, st.handle(NodeReport("r0", 1.0, node, running=())))
    st.handle(JobStarted("s", 2.0, "j", "n0"))
    st.handle(NodeReport("r1", 3.0, node, running=("j",)))
    out = st.handle(NodeReport("r2", 4.0, node, running=()))  # missing from now on
    assert min(w.at for w in of(Wakeup, out)) == pytest.approx(19.0)
    st.handle(NodeReport("r3", 10.0, node, running=("j",)))  # back: the count starts over
    st.handle(NodeReport("r4", 11.0, node, running=()))
    st.handle(NodeReport("r5", 20.0, node))  # a report that does not say is no evidence either way
    assert st.records["j"].job.state is JobState.RUNNING
    out = st.handle(Tick("t", 26.0))
    [rel] = of(Release, out)
    assert rel.state is JobState.FAILED and rel.stop and "no longer reports" in rel.reason
    assert st.records["j"].job.state is JobState.FAILED and st.free_gpus == 1


def test_a_start_acknowledged_by_a_node_the_job_is_not_on_is_refused():
    st = state(n=2)
    st.handle(JobArrived("a", 0.0, Job("j", "m")))
    where = st.records["j"].shards[0].node
    other = "n1" if where == "n0" else "n0"
    decisions, refused = st.handle_batch([JobStarted("s1", 1.0, "j", other), JobStarted("s2", 1.0, "j", where)])
    assert [sid for sid, _ in refused] == ["s1"] and "not placed on node" in refused[0][1]
    assert st.watch.started == {"j": {where}}


def test_a_bound_pod_takes_resources_without_a_place_and_its_hold_ends():
    st = SchedulerState("fifo", [Node("n0", 2, 8, 32 * GiB)], rules=RULES)
    pod = Job("k8s.ml.p", "unknown", gpus=1, cpus=2.0, memory_bytes=GiB)
    out = st.handle(JobBound("b", 1.0, pod, "n0", (), 120.0))
    assert not of(Place, out) and st.free_gpus == 1 and st.records["k8s.ml.p"].external
    assert min(w.at for w in of(Wakeup, out)) == pytest.approx(121.0)
    # The core will not place a 2-GPU job there while the pod holds a GPU...
    assert not of(Place, st.handle(JobArrived("a", 2.0, Job("big", "m", gpus=2))))
    # ...nor take a start confirmation for the pod (no dlshare daemon runs it).
    _, refused = st.handle_batch([JobStarted("s", 3.0, "k8s.ml.p", "n0")])
    assert refused
    out = st.handle(Tick("t", 121.0))
    [rel] = of(Release, out)
    assert rel.job == "k8s.ml.p" and rel.state is JobState.DONE and not rel.stop
    assert [p.job for p in of(Place, out)] == ["big"]


def test_a_bound_cpu_pod_reserves_its_request_and_gpus_are_picked_when_unsaid():
    st = SchedulerState("fifo", [Node("n0", 2, 8, 32 * GiB)])
    st.handle(JobBound("b", 1.0, Job("k8s.ml.c", "unknown", gpus=0, cpus=0.6, memory_bytes=320 << 20), "n0"))
    assert st.nodes["n0"].reserved_cpus == pytest.approx(0.6) and st.free_gpus == 2
    st.handle(JobBound("c", 2.0, Job("k8s.ml.g", "unknown", gpus=1, cpus=1.0), "n0", (7,)))  # 7: no such GPU
    assert st.records["k8s.ml.g"].shards[0].gpus == (0,)
    _, refused = st.handle_batch([JobBound("d", 3.0, Job("k8s.ml.g", "unknown", gpus=1, cpus=1.0), "n0")])
    assert "duplicate" in refused[0][1]
    _, refused = st.handle_batch([JobBound("e", 3.0, Job("k8s.x", "unknown", gpus=1, cpus=1.0), "nowhere")])
    assert "unknown" in refused[0][1]


def test_handle_batch_skips_refused_events_and_runs_one_pass():
    st = state(rules=None, n=1, gpus=2)
    decisions, refused = st.handle_batch([
        JobArrived("a", 1.0, Job("x", "m")), JobFinished("bad", 1.0, "nobody"), JobArrived("b", 1.0, Job("y", "m"))])
    assert [sid for sid, _ in refused] == ["bad"] and "unknown job" in refused[0][1]
    assert sorted(p.job for p in of(Place, decisions)) == ["x", "y"]
    assert all(d.stimulus_id == "b" for d in decisions)  # the pass ran once, after the last applied event
    assert of(Allocate, decisions)


def test_compact_forgets_finished_jobs_and_decides_the_same():
    def run(compact: bool):
        st = state(rules=None, n=2, gpus=2)
        out = []
        for i in range(6):
            out += st.handle(JobArrived(f"a{i}", float(i), Job(f"j{i}", "m")))
        for i in range(3):
            out += st.handle(JobFinished(f"f{i}", 10.0 + i, f"j{i}"))
            if compact:
                assert st.compact() == 1 and f"j{i}" not in st.records
        for i in range(6, 9):
            out += st.handle(JobArrived(f"a{i}", 20.0 + i, Job(f"j{i}", "m")))
        return out

    assert run(True) == run(False)


def test_answers_to_an_older_placement_or_from_another_node_are_refused():
    st = state(rules=None, n=2)
    st.handle(JobArrived("a", 0.0, Job("j", "m")))
    first = st.records["j"].shards[0].node
    assert st.records["j"].placed_by == "a"
    st.handle(PlacementFailed("f", 1.0, "j", "refused", place_id="a"))  # requeued and placed again by "f"
    assert st.records["j"].placed_by == "f"
    _, refused = st.handle_batch([PlacementFailed("late", 2.0, "j", "timeout", place_id="a"),
                                  JobStarted("late-ack", 2.0, "j", st.records["j"].shards[0].node, "a")])
    assert [sid for sid, _ in refused] == ["late", "late-ack"]
    assert st.records["j"].job.state is JobState.RUNNING
    where = st.records["j"].shards[0].node
    other = "n1" if where == "n0" else "n0"
    _, refused = st.handle_batch([JobFinished("x", 3.0, "j", node=other)])  # a stale exit from elsewhere
    assert refused and st.records["j"].job.state is JobState.RUNNING and first in ("n0", "n1")
    st.handle(JobFinished("y", 4.0, "j", node=where))
    assert st.records["j"].job.state is JobState.DONE


def test_a_job_a_node_runs_where_it_was_not_placed_is_released_there_once():
    st = state(rules=None, n=2)
    st.handle(JobArrived("a", 0.0, Job("j", "m")))
    where = st.records["j"].shards[0].node
    other = "n1" if where == "n0" else "n0"
    node = Node(other, 1, 8, 32 * GiB)
    # The other node says it runs j too (it was taken for lost and was not, say): stop it there.
    [rel] = of(Release, st.handle(NodeReport("r1", 1.0, node, running=("j", "unknown-job"))))
    assert rel.nodes == (other,) and rel.stop and rel.state is JobState.RUNNING and "not placed" in rel.reason
    assert not of(Release, st.handle(NodeReport("r2", 2.0, node, running=("j",))))  # once
    assert st.records["j"].job.state is JobState.RUNNING and st.records["j"].shards[0].node == where
    st.handle(NodeReport("r3", 3.0, node, running=()))  # it stopped
    assert of(Release, st.handle(NodeReport("r4", 4.0, node, running=("j",))))  # and if it runs again, again
