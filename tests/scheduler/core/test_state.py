"""The pure core (state, ledger, passes) driven with plain events: no network, no clock."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    Allocate, Job, JobArrived, JobCancelled, JobFinished, JobSample, JobState, Node, NodeLost, NodeReport, Place,
    PlacementFailed, Preempt, Reject, SchedulerError, SchedulerState, Tick, Wakeup, load_profile,
)
from tests.scheduler.core.helpers import make_state, nodes


def places(ds):
    return [d for d in ds if isinstance(d, Place)]


def test_fifo_places_and_allocates_proportionally():
    st = make_state("fifo")
    out = st.handle(JobArrived("a1", 0.0, Job("a", "ResNet-18", 32, gpus=2)))
    [p] = places(out)
    assert p.job == "a" and len(p.gpus) == 2 and p.stimulus_id == "a1"
    [alloc] = [d for d in out if isinstance(d, Allocate)]
    assert alloc.cpus == pytest.approx(6.0)  # 12 cores x 2/4 GPUs
    assert st.records["a"].job.state is JobState.RUNNING
    assert st.free_gpus == 6


def test_consolidate_fills_fullest_node_and_spread_the_emptiest():
    st = make_state("fifo")
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=3)))
    [p] = places(st.handle(JobArrived("2", 1, Job("b", "m", gpus=1))))
    assert p.node == st.records["a"].shards[0].node
    st = make_state("spread")
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=3)))
    [p] = places(st.handle(JobArrived("2", 1, Job("b", "m", gpus=1))))
    assert p.node != st.records["a"].shards[0].node


def test_fifo_head_of_line_and_backfill(tmp_path):
    strict = tmp_path / "strict.toml"
    strict.write_text('name="strict"\n[order]\nplugin="fifo"\n[placement]\nbackfill=false\n')
    for prof, expect_c in (("fifo", True), (str(strict), False)):
        st = SchedulerState(load_profile(prof), nodes(1, 4))
        st.handle(JobArrived("1", 0, Job("a", "m", gpus=3)))
        st.handle(JobArrived("2", 1, Job("b", "m", gpus=4)))  # cannot fit: waits
        out = st.handle(JobArrived("3", 2, Job("c", "m", gpus=1)))
        assert bool(places(out)) is expect_c, prof


def test_finish_frees_gpus_and_starts_next():
    st = make_state("fifo", n=1)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=4)))
    assert not places(st.handle(JobArrived("2", 1, Job("b", "m", gpus=2))))
    out = st.handle(JobFinished("3", 10, "a"))
    assert [p.job for p in places(out)] == ["b"]
    assert st.records["a"].job.state is JobState.DONE
    assert st.records["a"].job.attained_service == pytest.approx(40.0)  # 4 GPUs x 10 s
    assert st.records["b"].queueing_delay == pytest.approx(9.0)


def test_multi_node_job_spans_whole_nodes():
    st = make_state("fifo", n=3)
    [p] = places(st.handle(JobArrived("1", 0, Job("big", "m", gpus=8))))
    assert len(p.shards) == 2 and sum(len(s.gpus) for s in p.shards) == 8
    assert len({s.node for s in p.shards}) == 2


def test_job_larger_than_cluster_is_rejected():
    st = make_state("fifo", n=1)
    out = st.handle(JobArrived("1", 0, Job("huge", "m", gpus=16)))
    assert [type(d) for d in out] == [Reject]
    assert st.records["huge"].job.state is JobState.FAILED


def test_las_preempts_on_tick_and_asks_for_wakeups():
    st = make_state("las", n=1)
    st.handle(JobArrived("1", 0, Job("old", "m", gpus=4)))
    out = st.handle(JobArrived("2", 100, Job("new", "m", gpus=4)))
    assert not places(out)  # arrivals only fill free GPUs
    wake = [d for d in out if isinstance(d, Wakeup)]
    assert wake and wake[0].at > 100
    out = st.handle(Tick("t", wake[0].at))
    assert [d.job for d in out if isinstance(d, Preempt)] == ["old"]
    assert [p.job for p in places(out)] == ["new"]
    assert st.records["old"].job.state is JobState.PREEMPTED
    # the preempted job resumes later with resumed=True
    out = st.handle(Tick("t2", wake[0].at + 2000))
    assert any(isinstance(d, Place) and d.job == "old" and d.resumed for d in out)


def test_fifo_never_preempts_nor_wakes():
    st = make_state("fifo", n=1)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=4)))
    out = st.handle(JobArrived("2", 1, Job("b", "m", gpus=4)), Tick("t", 5000))
    assert not any(isinstance(d, (Preempt, Wakeup)) for d in out)


def test_node_lost_requeues_its_jobs_and_node_report_brings_it_back():
    st = make_state("fifo", n=1)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=2)))
    st.handle(NodeLost("l", 5, "n0"))
    assert st.records["a"].job.state is JobState.PREEMPTED and st.total_gpus == 0
    out = st.handle(NodeReport("r", 6, Node("n0", 4, 12, 1 << 30)))
    assert [p.job for p in places(out)] == ["a"]


def test_new_node_from_report_is_used():
    st = SchedulerState("fifo")
    assert not places(st.handle(JobArrived("1", 0, Job("a", "m", gpus=2))))
    out = st.handle(NodeReport("r", 1, Node("fresh", 2, 8, 1 << 30)))
    assert places(out)[0].node == "fresh"


def test_bad_events_raise_and_leave_state_alone():
    st = make_state("fifo")
    st.handle(JobArrived("1", 10, Job("a", "m")))
    with pytest.raises(SchedulerError, match="duplicate"):
        st.handle(JobArrived("2", 11, Job("a", "m")))
    with pytest.raises(SchedulerError, match="unknown job"):
        st.handle(JobFinished("3", 12, "nope"))
    with pytest.raises(SchedulerError, match="backwards"):
        st.handle(Tick("4", 1))
    st.handle(JobFinished("5", 13, "a"))
    with pytest.raises(SchedulerError, match="already done"):
        st.handle(JobFinished("6", 14, "a"))


def test_cancel_queued_job():
    st = make_state("fifo", n=1)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=4)), JobArrived("2", 0, Job("b", "m", gpus=4)))
    st.handle(JobCancelled("3", 1, "b"))
    assert st.records["b"].job.state is JobState.FAILED and "b" not in st.waiting
    assert not places(st.handle(JobFinished("4", 2, "a")))


def test_same_events_same_decisions():
    def run(seed):
        st = make_state("gandiva", n=2, seed=seed)
        out = []
        for i in range(14):
            out += st.handle(JobArrived(f"a{i}", i, Job(f"j{i}", "ResNet-18", 32, gpus=1)))
        return out

    assert run(1) == run(1)


def test_colocation_when_full_and_incompatible_pairs_are_remembered():
    st = make_state("gandiva", n=1, gpus=1)
    st.handle(JobArrived("1", 0, Job("a", "A", gpus=1)))
    [p] = places(st.handle(JobArrived("2", 1, Job("b", "B", gpus=1))))
    assert p.colocated_with == ("a",)
    st.handle(PlacementFailed("3", 2, "b", "OOM"))
    assert st.records["b"].job.state is JobState.PREEMPTED
    assert not places(st.handle(Tick("4", 3)))  # the A/B pairing is not tried again
    st.handle(JobArrived("5", 4, Job("c", "C", gpus=1)))
    assert st.records["c"].job.state is JobState.RUNNING


def test_node_report_samples_feed_pair_speeds():
    st = make_state("gandiva", n=1, gpus=1)
    st.handle(JobArrived("1", 0, Job("a", "A", gpus=1)), JobArrived("2", 0, Job("b", "B", gpus=1)))
    st.handle(NodeReport("r", 5, Node("n0", 1, 12, 256 << 30), jobs={"a": JobSample(speed=0.9), "b": JobSample(speed=0.7)}))
    assert st.predictors.pairs.get("A", ["B"]) == pytest.approx(0.9)
    assert st.predictors.colocated_speeds("B", ["A"]) == pytest.approx([0.7, 0.9])


def test_candidates_rank_without_changing_state():
    st = make_state("fifo", n=3)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=2)))
    before = (st.free_gpus, dict(st.waiting))
    ranked = st.candidates(Job("probe", "m", gpus=2))
    assert (st.free_gpus, dict(st.waiting)) == before
    assert ranked[0][0].node.node.id == st.records["a"].shards[0].node  # consolidate
    assert ranked[0][1] >= ranked[-1][1]
    assert st.candidates(Job("probe", "m", gpus=2), node_ids=["n2"])[0][0].node.node.id == "n2"


def test_min_run_protects_young_jobs_and_wakes_when_it_expires(tmp_path):
    prof = tmp_path / "p.toml"
    prof.write_text('name="p"\n[order]\nplugin="las"\n[placement]\nmin_run_s=1000\n')
    st = SchedulerState(load_profile(prof), nodes(1, 4))
    st.handle(JobArrived("1", 0, Job("old", "m", gpus=4)))
    out = st.handle(JobArrived("2", 100, Job("new", "m", gpus=4)), Tick("t", 500))
    assert not any(isinstance(d, Preempt) for d in out)  # 'old' ran only 500 s
    wakes = [d.at for d in out if isinstance(d, Wakeup)]
    assert wakes and min(wakes) > 500
    out = st.handle(Tick("t2", 1001))
    assert [d.job for d in out if isinstance(d, Preempt)] == ["old"]


@pytest.mark.parametrize("profile", ["fifo", "las", "gandiva", "dlshare"])
def test_incremental_indexes_stay_consistent_under_random_events(profile):
    import random as _r

    rng = _r.Random(7)
    st = make_state(profile, n=4, gpus=4)
    now = 0.0
    live: list[str] = []
    for k in range(300):
        now += rng.uniform(0, 50)
        roll = rng.random()
        if roll < 0.5:
            jid = f"j{k}"
            st.handle(JobArrived(f"a{k}", now, Job(jid, rng.choice("ABC"), 8, gpus=rng.choice([1, 1, 2, 4, 8]))))
            live.append(jid)
        elif roll < 0.8 and live:
            jid = live.pop(rng.randrange(len(live)))
            if st.records[jid].job.state.active:
                st.handle(JobFinished(f"f{k}", now, jid))
        elif roll < 0.9:
            st.handle(Tick(f"t{k}", now))
        else:
            node = f"n{rng.randrange(4)}"
            if st.nodes[node].alive:
                st.handle(NodeLost(f"l{k}", now, node))
            else:
                st.handle(NodeReport(f"r{k}", now, Node(node, 4, 12, 256 << 30)))
        alive = [ns for ns in st.nodes.values() if ns.alive]
        assert st.free_gpus == sum(sum(1 for r in ns.residents if not r) for ns in alive)
        assert st.total_gpus == sum(ns.node.gpus for ns in alive)
        led = st.ledger
        assert led.share_slots == sum(led.slot(r) for ns in alive for r in ns.residents)
        assert sorted(led.wait_order) == led.wait_order and {j for _, j in led.wait_order} == set(st.waiting)
        for ns in alive:
            assert ns.node.id in led.by_free[ns.free_gpus]
        for rec in st.running.values():
            assert all(rec.job.id in st.nodes[sh.node].residents[g] for sh in rec.shards for g in sh.gpus)
            assert sum(len(sh.gpus) for sh in rec.shards) == rec.job.gpus


def test_explain_gives_a_reason_per_rejected_node():
    st = make_state("fifo", n=3)
    st.handle(JobArrived("1", 0, Job("a", "m", gpus=3)))
    st.handle(NodeLost("2", 1, "n2"))
    why = st.explain(Job("probe", "m", gpus=2))
    assert "n0" in why and "free GPUs" in why["n0"]  # 'a' left one GPU there
    assert why["n2"] == "node offline"
    assert "n1" not in why  # it fits there
    assert st.explain(Job("probe", "m", gpus=2), ["nope"]) == {"nope": "unknown node"}


job_ids = st.sampled_from(["a", "b", "c", "d"])
node_ids = st.sampled_from(["n0", "n1", "n2"])
event = st.one_of(
    st.builds(lambda j, g, m: ("arrive", j, g, m), job_ids, st.integers(1, 9), st.sampled_from("XY")),
    st.builds(lambda j, f: ("finish", j, f), job_ids, st.booleans()),
    st.builds(lambda j: ("cancel", j), job_ids),
    st.builds(lambda j: ("failed", j), job_ids),
    st.just(("tick",)),
    st.builds(lambda n, g, s: ("report", n, g, s), node_ids, st.integers(0, 4), st.floats(0, 2)),
    st.builds(lambda n: ("lost", n), node_ids),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["fifo", "las", "gandiva", "dlshare"]), st.lists(st.tuples(event, st.floats(-5, 100)), max_size=25))
def test_core_never_fails_except_with_scheduler_error(profile, steps):
    core = SchedulerState(profile, [Node("n0", 2, 8, 1 << 34)])
    now = 0.0
    for k, (ev, dt) in enumerate(steps):
        now += dt
        kind = ev[0]
        if kind == "arrive":
            e = JobArrived(f"e{k}", now, Job(ev[1], ev[3], gpus=ev[2]))
        elif kind == "finish":
            e = JobFinished(f"e{k}", now, ev[1], failed=ev[2])
        elif kind == "cancel":
            e = JobCancelled(f"e{k}", now, ev[1])
        elif kind == "failed":
            e = PlacementFailed(f"e{k}", now, ev[1])
        elif kind == "tick":
            e = Tick(f"e{k}", now)
        elif kind == "report":
            e = NodeReport(f"e{k}", now, Node(ev[1], ev[2], 8, 1 << 34),
                           jobs={j: JobSample(speed=ev[3]) for j in core.running})
        else:
            e = NodeLost(f"e{k}", now, ev[1])
        before = core.now
        try:
            core.handle(e)
        except SchedulerError:
            assert core.now == before  # a refused event leaves the clock alone
            now = max(now, core.now)
            continue
        alive = [ns for ns in core.nodes.values() if ns.alive]
        assert core.free_gpus == sum(sum(1 for r in ns.residents if not r) for ns in alive)
        for rec in core.running.values():
            assert all(rec.job.id in core.nodes[sh.node].residents[g] for sh in rec.shards for g in sh.gpus)
