"""Quotas in the core: a job over its owner's (user's or account's) limit on GPUs in use or lent
memory waits and says why, on every node and in the extender's answers; it starts when the
owner's other job ends; a job no limit could ever admit, or one past the waiting-jobs limit, is
rejected.  No run ever holds more than a limit, whatever the order."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    Allocate, Job, JobArrived, JobFinished, Node, Place, Preempt, Reject, SchedulerState, Tick, load_profile,
)
from scheduler.model import GiB, JobState
from scheduler.predictors import Predictors
from scheduler.predictors.sensitivity import SensitivityModel
from scheduler.profile import ProfileError, parse_profile

GB = 10 ** 9


def profile(order: str = "fifo", allocate: str = "proportional", **quota):
    base = load_profile(order)
    return parse_profile({"name": f"{order}+quota", "order": {"plugin": base.order.plugin, "args": dict(base.order.args)},
                          "allocate": allocate, "quota": quota}, f"{order}+quota")


def core(prof, gpus: int = 4, nodes: int = 1) -> SchedulerState:
    return SchedulerState(prof, [Node(f"n{i}", gpus, 16, 256 * GiB) for i in range(nodes)], rng=random.Random(0))


def job(jid: str, user: str, gpus: int = 1, account: str = "", **kw) -> Job:
    return Job(jid, "ResNet-18", 32, gpus=gpus, user=user, account=account, **kw)


def placed(out) -> list[str]:
    return [d.job for d in out if isinstance(d, Place)]


def test_a_job_over_the_gpu_quota_waits_with_the_reason_and_starts_when_the_other_ends():
    st = core(profile(users={"alice": {"gpus": 2}}))
    assert placed(st.handle(JobArrived("a", 0.0, job("j1", "alice", gpus=2)))) == ["j1"]
    out = st.handle(JobArrived("b", 1.0, job("j2", "alice")), JobArrived("c", 1.0, job("k1", "bob")))
    assert placed(out) == ["k1"]  # bob is not held back by alice's limit (the GPUs are free)
    why = st.explain(st.job("j2").job)
    assert why == {"n0": "user 'alice' holds 2 of its 2 GPUs (quota); the job needs 1"}
    assert st.quota_reason(st.job("j2").job) == why["n0"] and st.candidates(st.job("j2").job) == []
    assert placed(st.handle(JobFinished("f", 5.0, "j1"))) == ["j2"]
    assert st.quota_reason(st.job("j2").job) == ""  # running within its quota


def test_defaults_apply_to_every_user_and_a_users_table_overrides_them():
    st = core(profile(default_user={"gpus": 1}, users={"alice": {"gpus": 3}}), gpus=8)
    out = st.handle(*[JobArrived(f"e{i}", 0.0, job(f"{u}{i}", u)) for i in range(4) for u in ("alice", "bob", "")])
    got = placed(out)
    assert sorted(j for j in got if j.startswith("alice")) == ["alice0", "alice1", "alice2"]
    assert [j for j in got if j.startswith("bob")] == ["bob0"] and got.count("0") == 1  # "" is one user too
    assert "the anonymous user holds 1 of its 1 GPUs" in st.quota_reason(st.job("1").job)


def test_account_limits_hold_every_user_of_the_account():
    st = core(profile(accounts={"vision": {"gpus": 3}}), gpus=8)
    out = st.handle(JobArrived("a", 0.0, job("a1", "alice", 2, "vision")), JobArrived("b", 0.0, job("b1", "bob", 2, "vision")),
                    JobArrived("c", 0.0, job("c1", "carol", 2, "speech")), JobArrived("d", 0.0, job("d1", "dan", 2)))
    assert placed(out) == ["a1", "c1", "d1"]
    assert st.quota_reason(st.job("b1").job).startswith("account 'vision' holds 2 of its 3 GPUs")
    assert placed(st.handle(JobFinished("f", 9.0, "a1"))) == ["b1"]


def test_jobs_no_limit_admits_and_jobs_past_the_waiting_limit_are_rejected():
    st = core(profile(users={"alice": {"gpus": 2, "queued": 2}}), gpus=4)
    out = st.handle(JobArrived("a", 0.0, job("big", "alice", gpus=4)))
    assert [d.reason for d in out if isinstance(d, Reject)] == ["needs 4 GPUs; user 'alice' may hold at most 2 (quota)"]
    for i in range(3):  # one runs, two wait
        st.handle(JobArrived(f"e{i}", 1.0, job(f"j{i}", "alice", gpus=2)))
    out = st.handle(JobArrived("x", 2.0, job("j9", "alice")))
    assert [d.reason for d in out if isinstance(d, Reject)] == ["user 'alice' has 2 jobs waiting; its quota is 2"]
    assert st.job("j9").job.state is JobState.FAILED
    assert placed(st.handle(JobArrived("y", 2.0, job("k", "bob", gpus=2)))) == ["k"]  # bob has no limit


def test_a_preemptive_order_spends_a_users_quota_on_its_best_jobs():
    st = core(profile("las", users={"alice": {"gpus": 1}}))
    st.handle(JobArrived("a", 0.0, job("old", "alice")))
    out = st.handle(JobArrived("b", 3600.0, job("new", "alice")), Tick("t", 3600.0))
    # LAS ranks the newcomer first; the quota lets one run: the one that ran an hour yields
    assert placed(out) == ["new"] and [d.job for d in out if isinstance(d, Preempt)] == ["old"]
    assert "holds 1 of its 1 GPUs" in st.explain(st.job("old").job)["n0"]


def test_an_account_limit_in_a_preemptive_order_yields_only_the_accounts_own_jobs():
    st = core(profile("las", accounts={"lab": {"gpus": 1}}), gpus=2)
    st.handle(JobArrived("a", 0.0, job("bob1", "bob", 1, "lab")), JobArrived("b", 0.0, job("dan1", "dan")))
    out = st.handle(JobArrived("c", 3600.0, job("alice1", "alice", 1, "lab")), Tick("t", 3600.0))
    # alice's newcomer ranks first under LAS; the lab's one GPU goes to it, and only bob's job yields
    assert placed(out) == ["alice1"] and [d.job for d in out if isinstance(d, Preempt)] == ["bob1"]
    assert st.job("dan1").job.state is JobState.RUNNING
    assert st.quota_reason(st.job("bob1").job).startswith("account 'lab' holds 1 of its 1 GPUs")


# ---------------------------------------------------------------- never over a limit, whatever happens


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), order=st.sampled_from(["fifo", "las", "dlshare"]))
def test_no_owner_ever_holds_more_gpus_than_its_limits(seed, order):
    limits = {"users": {"a": {"gpus": 2}, "b": {"gpus": 3}}, "accounts": {"lab": {"gpus": 4}},
              "default_user": {"gpus": 5}}
    st_ = SchedulerState(profile(order, **limits), [Node(f"n{i}", 4, 16, 64 * GiB) for i in range(3)],
                         predictors=Predictors.default(), rng=random.Random(seed))
    rng = random.Random(seed)
    t, live = 0.0, []
    for k in range(80):
        t += rng.uniform(1.0, 600.0)
        if rng.random() < 0.6 or not live:
            j = Job(f"j{k}", "ResNet-18", 32, gpus=rng.choice([1, 1, 2]), user=rng.choice("abc"),
                    account=rng.choice(["", "lab"]))
            live.append(j.id)
            st_.handle(JobArrived(f"e{k}", t, j))
        elif rng.random() < 0.7:
            st_.handle(JobFinished(f"e{k}", t, live.pop(rng.randrange(len(live)))))
        else:
            st_.handle(Tick(f"e{k}", t))
        held: dict = {}
        for r in st_.running.values():
            for key in (("user", r.job.user), ("account", r.job.account) if r.job.account else None):
                if key:
                    held[key] = held.get(key, 0) + r.job.gpus
        assert held.get(("user", "a"), 0) <= 2 and held.get(("user", "b"), 0) <= 3
        assert held.get(("user", "c"), 0) <= 5 and held.get(("account", "lab"), 0) <= 4
        assert held == {k: v for k, v in st_.ledger.owners.gpus_by.items() if v}  # the books agree


# ---------------------------------------------------------------- lent memory

SENS = {"img_1": {"model": "img", "num_gpus": 1, "batch_size": 512, "iter_time_s": 0.6,
                  "throughput": [[0.1, 0.3], [0.1, 0.66], [0.1, 1.0]]}}


def lent_core(**quota) -> SchedulerState:
    """1-GPU nodes with half the memory their jobs' top level needs, and a donor with 500 GB."""
    nodes = [Node(f"g{i}", 1, 3, int(31.25 * GB)) for i in range(3)]
    nodes.append(Node("prep", 0, 8, 500 * GB, lendable_bytes=500 * GB))
    preds = Predictors(sensitivity=SensitivityModel([1, 2, 3], [20.83, 62.5], SENS))
    return SchedulerState(profile("fifo", "lent", **quota), nodes, predictors=preds, rng=random.Random(0))


def lent_to(st, user: str) -> int:
    return sum(sum(d.values()) for (jid, _), d in st.ledger.pool.holds.items() if st.records[jid].job.user == user)


def test_the_lent_allocator_stays_within_a_users_lent_memory_quota():
    free = lent_core()
    free.handle(*[JobArrived(f"e{i}", 0.0, Job(f"j{i}", "img", gpus=1, user="alice")) for i in range(2)])
    each = lent_to(free, "alice") // 2
    assert each > 0  # without a quota each job borrows up to its level
    st = lent_core(users={"alice": {"remote_memory_bytes": each + each // 2}})
    out = st.handle(*[JobArrived(f"e{i}", 0.0, Job(f"j{i}", "img", gpus=1, user="alice")) for i in range(2)],
                    JobArrived("b", 0.0, Job("k", "img", gpus=1, user="bob")))
    assert sorted(placed(out)) == ["j0", "j1", "k"]  # asking nothing, nobody waits: they borrow less
    assert lent_to(st, "alice") <= each + each // 2 and lent_to(st, "bob") >= each
    assert all(d.remote_memory_bytes <= each + each // 2 for d in out if isinstance(d, Allocate))


def test_a_lent_memory_minimum_over_the_quota_waits_or_is_rejected():
    st = lent_core(users={"alice": {"remote_memory_bytes": 50 * GB}})
    out = st.handle(JobArrived("a", 0.0, Job("j1", "img", gpus=1, user="alice", remote_memory_bytes=40 * GB)),
                    JobArrived("b", 0.0, Job("j2", "img", gpus=1, user="alice", remote_memory_bytes=20 * GB)),
                    JobArrived("c", 0.0, Job("j3", "img", gpus=1, user="alice", remote_memory_bytes=60 * GB)))
    assert placed(out) == ["j1"]
    assert [d.reason for d in out if isinstance(d, Reject)] == [
        f"needs {60 * GB} bytes of lent memory; user 'alice' may borrow at most {50 * GB} (quota)"]
    why = st.explain(st.job("j2").job)
    assert set(why) == {"g0", "g1", "g2", "prep"} and "user 'alice' borrows" in why["g1"] and "(quota)" in why["g1"]
    assert placed(st.handle(JobFinished("f", 9.0, "j1"))) == ["j2"]


@pytest.mark.parametrize("bad, key", [
    ({"users": {"alice": {"gpus": -1}}}, "quota.users.alice.gpus"), ({"users": {"alice": {"gpus": 1.5}}}, "whole number"),
    ({"default_user": {"cpus": 1}}, "unknown quota.default_user keys"), ({"groups": {}}, r"unknown \[quota\] keys"),
    ({"accounts": {"lab": 3}}, "quota.accounts.lab must be a table"),
])
def test_bad_quota_tables_are_named(bad, key):
    with pytest.raises(ProfileError, match="x.toml: .*" + key):
        parse_profile({"order": "fifo", "quota": bad}, "x.toml")
