"""Why a job waits (scheduler.waiting): each reason code from the part of the core that holds the
job back, in its words; the reason follows its cause; explaining changes nothing."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    Job, JobArrived, JobFinished, Node, NodeLost, Place, PlacementFailed, SchedulerState, WatchRules,
    load_profile, snapshot,
)
from scheduler.framework import register
from scheduler.model import GiB
from scheduler.predictors import Predictors
from scheduler.predictors.sensitivity import SensitivityModel
from scheduler.profile import parse_profile
from scheduler.waiting import explain_queue, nodes_summary, size, why_waiting

GB = 10 ** 9


def core(profile="fifo", nodes=2, gpus=4, cores=12, **kw) -> SchedulerState:
    prof = profile if not isinstance(profile, str) else load_profile(profile)
    return SchedulerState(prof, [Node(f"n{i}", gpus, cores, 256 * GiB) for i in range(nodes)],
                          rng=random.Random(0), **kw)


def arrive(st, jid, gpus=1, t=0.0, **kw):
    return st.handle(JobArrived(f"a-{jid}", t, Job(jid, "ResNet-18", 32, gpus=gpus, **kw)))


def test_an_8_gpu_job_on_a_cluster_with_7_of_8_in_use_needs_gpus_and_the_reason_follows_the_cause():
    st = core()
    arrive(st, "big4", 4)
    arrive(st, "three", 3)
    arrive(st, "gang", 8, t=1.0)
    why = why_waiting(st, "gang")
    assert (why.code, why.message) == ("Resources", "needs 8 GPUs on 2 nodes; 1 free")
    assert why.nodes.startswith("0/2 nodes are available: 2 needs 8 GPUs")
    st.handle(JobFinished("f1", 5.0, "three"))
    assert why_waiting(st, "gang").message == "needs 8 GPUs on 2 nodes; 4 free"
    st.handle(JobFinished("f2", 6.0, "big4"))
    assert st.job("gang").job.state.value == "running" and not st.waiting
    st2 = core()
    arrive(st2, "big4", 4)
    arrive(st2, "three", 3)
    arrive(st2, "gang", 8, t=1.0)
    arrive(st2, "one", 1, t=2.0)  # takes the last GPU (backfill)
    assert why_waiting(st2, "gang").message == "needs 8 GPUs on 2 nodes; 0 free"
    st2.handle(JobFinished("f2", 5.0, "one"))
    assert why_waiting(st2, "gang").message == "needs 8 GPUs on 2 nodes; 1 free"


def test_behind_jobs_of_higher_priority_when_it_fits_but_the_order_puts_others_first():
    prof = parse_profile({"name": "fifo-strict", "order": "fifo", "placement": {"backfill": False}}, "fifo-strict")
    st = core(prof)
    arrive(st, "r", 7)
    arrive(st, "head", 8, t=1.0)
    arrive(st, "small", 1, t=2.0)  # one GPU is free, but strict FIFO keeps it behind the head
    order, why = explain_queue(st)
    assert order == ["head", "small"]
    assert why["head"].code == "Resources"
    assert (why["small"].code, why["small"].message) == ("Priority", "behind 1 job of higher priority")
    assert why_waiting(st, "small") == why["small"]  # alone or with the queue: the same


def test_one_job_per_size_fragmentation_is_named():
    st = core()
    arrive(st, "a", 3)
    arrive(st, "b", 3)
    arrive(st, "two", 2, t=1.0)
    assert why_waiting(st, "two").message == "needs 2 GPUs on one node; 2 free, at most 1 on one node"


def test_a_cpu_only_job_names_the_cores_and_memory_it_lacks():
    st = core(nodes=1, cores=8)
    st.handle(JobArrived("a", 0.0, Job("prep", "decode", gpus=0, cpus=6, memory_bytes=4 * GiB)))
    st.handle(JobArrived("b", 0.0, Job("prep2", "decode", gpus=0, cpus=4, memory_bytes=4 * GiB)))
    why = why_waiting(st, "prep2")
    assert why.code == "Resources"
    assert why.message == "needs 4 cores and 4.0 GiB on one node; at most 2 cores and 252.0 GiB free on one"


def test_the_owners_quota_comes_first():
    prof = parse_profile({"name": "q", "order": "fifo", "quota": {"users": {"alice": {"gpus": 1}}}}, "q")
    st = core(prof)
    arrive(st, "a1", 1, user="alice")
    arrive(st, "a2", 1, t=1.0, user="alice")
    why = why_waiting(st, "a2")
    assert why.code == "QuotaLimit" and "user 'alice' holds 1 of its 1 GPUs (quota)" in why.message


def test_a_failed_start_waits_out_its_backoff_then_names_what_it_waits_for():
    st = core(nodes=1, rules=WatchRules(backoff_s=10.0))
    arrive(st, "j", 4)
    st.handle(PlacementFailed("pf", 1.0, "j", "node refused"))
    why = why_waiting(st, "j")
    assert why.code == "Backoff" and why.message == "its start failed (1x); tried again in 10 s"


def test_no_node_online():
    st = core(nodes=1)
    arrive(st, "r", 4)
    arrive(st, "w", 4)
    st.handle(NodeLost("lost", 1.0, "n0"))
    assert why_waiting(st, "r") == why_waiting(st, "w")
    assert why_waiting(st, "w").code == "NoNodes"


@register("filter", "test-refuse-nodes")
class RefuseNodes:
    """A test filter: refuses the nodes it names, in its own words."""

    def __init__(self, nodes: list[str] = ()) -> None:
        self.nodes = set(nodes)

    def filter(self, rec, cand, ctx):
        return f"node {cand.node.node.id} is drained (test)" if cand.node.node.id in self.nodes else None


def refusing(*nodes: str):
    return parse_profile({"name": "refuse", "order": "fifo",
                          "filter": [{"plugin": "test-refuse-nodes", "args": {"nodes": list(nodes)}}]}, "refuse")


def test_a_gang_with_enough_free_gpus_but_nodes_without_room_for_their_part():
    st = core(refusing("n0"), nodes=3)  # a spread candidate is filtered on its first node
    arrive(st, "gang", 12)
    why = why_waiting(st, "gang")
    assert why.code == "Gang" and why.message == "gang: 2 of 3 nodes have room for their part (12 GPUs free)"


def test_a_filter_that_refuses_every_node_speaks_for_itself():
    st = core(refusing("n0", "n1"))
    arrive(st, "j", 1)
    why = why_waiting(st, "j")
    assert why.code == "Placement"
    assert why.message in ("node n0 is drained (test) (1 of 2 nodes)", "node n1 is drained (test) (1 of 2 nodes)")
    assert why.nodes == "0/2 nodes are available: 1 node n0 is drained (test), 1 node n1 is drained (test)"


def test_lent_memory_a_job_must_borrow():
    sens = {"img_1": {"model": "img", "num_gpus": 1, "batch_size": 512, "iter_time_s": 0.6,
                      "throughput": [[0.1, 0.3], [0.1, 0.66], [0.1, 1.0]]}}
    prof = parse_profile({"name": "lent", "order": "fifo", "allocate": "lent"}, "lent")
    nodes = [Node("g0", 1, 3, int(31.25 * GB)), Node("g1", 1, 3, int(31.25 * GB)),
             Node("prep", 0, 8, 500 * GB, lendable_bytes=50 * GB)]
    preds = Predictors(sensitivity=SensitivityModel([1, 2, 3], [20.83, 62.5], sens))
    st = SchedulerState(prof, nodes, predictors=preds, rng=random.Random(0))
    st.handle(JobArrived("a", 0.0, Job("j1", "img", gpus=1, remote_memory_bytes=40 * GB)))
    st.handle(JobArrived("b", 0.0, Job("j2", "img", gpus=1, remote_memory_bytes=20 * GB)))
    why = why_waiting(st, "j2")
    assert why.code == "LentMemory"
    assert why.message == f"waits for lent memory ({size(20 * GB)}; {size(10 * GB)} free)"


def test_nodes_summary_reads_like_kube_scheduler():
    assert nodes_summary({"a": "x", "b": "x", "c": "y"}, 4) == "1/4 nodes are available: 2 x, 1 y"
    assert nodes_summary({}, 3) == ""


def _random_events(seed: int):
    rng = random.Random(seed)
    evs, t, running = [], 0.0, []
    for i in range(40):
        t += rng.uniform(0, 300)
        if running and rng.random() < 0.35:
            evs.append(JobFinished(f"f{i}", t, running.pop(rng.randrange(len(running)))))
        else:
            jid = f"j{i}"
            evs.append(JobArrived(f"e{i}", t, Job(jid, rng.choice(["ResNet-18", "LM"]), 32,
                                                  gpus=rng.choice([1, 2, 4, 8]), user=rng.choice("ab"))))
            running.append(jid)
    return evs


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), order=st.sampled_from(["fifo", "las", "tiresias"]))
def test_explaining_the_queue_changes_nothing(seed, order):
    plain = core(order)
    asked = core(order)
    for ev in _random_events(seed):
        a = plain.handle_batch([ev])
        before = snapshot.dump(asked)
        explain_queue(asked)
        assert snapshot.dump(asked) == before  # not a byte of the core moved
        assert asked.handle_batch([ev]) == a
        for jid in asked.waiting:
            assert why_waiting(asked, jid).message  # every waiting job has a reason


def test_every_reason_of_a_busy_queue_is_one_of_the_codes():
    st = core("las")
    for i, g in enumerate([4, 4, 2, 8, 1, 1, 3]):
        arrive(st, f"j{i}", g, t=float(i))
    _, why = explain_queue(st)
    assert set(why) == set(st.waiting)
    assert all(w.code in ("Resources", "Priority", "Gang") for w in why.values())
    placed = [d.job for d in st.handle(JobFinished("f", 100.0, "j0")) if isinstance(d, Place)]
    assert placed and all(p not in explain_queue(st)[1] for p in placed)
