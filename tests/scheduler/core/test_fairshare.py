"""Fair share between users in the core's order: a flooding user's jobs wait behind the others',
decayed usage gives a user its place back, shares weight usage, and jobs of owners on one level
keep the profile's own order.  Decay runs on event times, so runs, replays and snapshots agree."""

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    Job, JobArrived, JobFinished, Node, Place, Preempt, SchedulerState, Tick, load_profile, snapshot,
)
from scheduler.codec import decision_to_dict, event_from_dict, event_to_dict
from scheduler.fairshare import HALF_LIFE_S, FairShareConfig, Owners
from scheduler.model import GiB
from scheduler.profile import ProfileError, parse_profile
from scheduler.sim import Cluster, simulate
from scheduler.trace import TraceJob, parse_trace

H = 3600.0


def profile(order: str = "fifo", **fs):
    """A packaged profile with fair share on (``fs``: [fairshare] keys, as TOML gives them)."""
    base = load_profile(order)
    table = {"order": {"plugin": base.order.plugin, "args": dict(base.order.args)}, "name": f"{order}+fs",
             "fairshare": {"enabled": True, **fs}}
    return parse_profile(table, f"{order}+fs")


def core(prof, gpus: int = 1, nodes: int = 1) -> SchedulerState:
    return SchedulerState(prof, [Node(f"n{i}", gpus, 12, 256 * GiB) for i in range(nodes)], rng=random.Random(0))


def placed(out) -> list[str]:
    return [d.job for d in out if isinstance(d, Place)]


def job(jid: str, user: str, arrival: float, gpus: int = 1, account: str = "") -> Job:
    return Job(jid, "ResNet-18", 32, gpus=gpus, arrival=arrival, user=user, account=account)


# ---------------------------------------------------------------- usage


def test_usage_decays_with_event_times_exactly():
    own = Owners(half_life_s=H)
    j = job("a", "alice", 0.0, gpus=2)
    own.running(j, +1, 0.0)
    tau = H / math.log(2)
    assert own.value(("", "alice"), H) == pytest.approx(2 * tau * 0.5)  # one half-life of 2 GPUs
    own.running(j, -1, H)
    at_stop = own.value(("", "alice"), H)
    assert own.value(("", "alice"), 3 * H) == pytest.approx(at_stop / 4)  # two half-lives idle
    assert own.gpus_by == {} and own.value(("", "bob"), 5 * H) == 0.0
    flat = Owners(half_life_s=0)  # no decay: plain GPU-seconds
    flat.running(j, +1, 10.0)
    assert flat.value(("", "alice"), 110.0) == pytest.approx(200.0)


def test_defaults_are_slurms_and_fair_share_is_off_unless_asked():
    assert HALF_LIFE_S == 7 * 86400  # PriorityDecayHalfLife=7-0
    assert not load_profile("fifo").fairshare.enabled and not load_profile("las").fairshare.enabled
    assert load_profile("dlshare").fairshare.enabled
    assert FairShareConfig().half_life_s == HALF_LIFE_S


# ---------------------------------------------------------------- the order


def _flood(prof) -> list[str]:
    st = core(prof, gpus=2)
    st.handle(*[JobArrived(f"f{i}", 0.0, job(f"f{i}", "flood", 0.0)) for i in range(10)])
    st.handle(JobArrived("b", 100.0, job("b", "bob", 100.0)))
    return placed(st.handle(JobFinished("x", 200.0, "f0")))


def test_a_flooding_users_jobs_do_not_starve_anothers():
    assert _flood(profile("fifo")) == ["b"]  # bob's job is next, ahead of the flood's eight
    assert _flood(load_profile("fifo")) == ["f2"]  # without fair share: arrival order


def _after_history(prof) -> list[str]:
    """alice ran 10 h long ago, bob 2 h just now; both wait for the one GPU, bob's job first in."""
    st = core(prof, gpus=1)
    st.handle(JobArrived("a0", 0.0, job("a0", "alice", 0.0)))
    st.handle(JobFinished("a0f", 10 * H, "a0"), JobArrived("b0", 10 * H, job("b0", "bob", 10 * H)))
    st.handle(JobArrived("b1", 11.9 * H, job("b1", "bob", 11.9 * H)))
    st.handle(JobArrived("a1", 11.95 * H, job("a1", "alice", 11.95 * H)))
    return placed(st.handle(JobFinished("b0f", 12 * H, "b0")))


def test_decay_restores_a_users_priority():
    assert _after_history(profile("fifo", half_life_s=H)) == ["a1"]  # alice's 10 h decayed below bob's 2 h
    assert _after_history(profile("fifo", half_life_s=0)) == ["b1"]  # without decay alice stays behind


def _shared(**fs) -> list[str]:
    st = core(profile("fifo", half_life_s=0, **fs), gpus=1)
    st.handle(JobArrived("a0", 0.0, job("a0", "alice", 0.0)))
    st.handle(JobFinished("a0f", H, "a0"), JobArrived("b0", H, job("b0", "bob", H)))
    st.handle(JobArrived("b1", 1.5 * H, job("b1", "bob", 1.5 * H)), JobArrived("a1", 1.6 * H, job("a1", "alice", 1.6 * H)))
    return placed(st.handle(JobFinished("b0f", 2 * H, "b0")))


def test_shares_weight_usage():
    assert _shared() == ["b1"]  # equal usage, equal shares: one level, FIFO decides
    assert _shared(shares={"alice": 4.0}) == ["a1"]  # alice's hour counts a quarter as much


def test_account_shares_rank_accounts_before_their_users():
    st = core(profile("fifo", half_life_s=0, account_shares={"vision": 4.0}), gpus=1)
    st.handle(JobArrived("a0", 0.0, job("a0", "alice", 0.0, account="vision")))
    st.handle(JobFinished("a0f", H, "a0"), JobArrived("b0", H, job("b0", "bob", H, account="speech")))
    st.handle(JobArrived("b1", 1.5 * H, job("b1", "bob", 1.5 * H, account="speech")),
              JobArrived("c1", 1.6 * H, job("c1", "carol", 1.6 * H, account="vision")))
    # carol never ran, but her account used as much as bob's: the account's 4 shares put her first.
    assert placed(st.handle(JobFinished("b0f", 2 * H, "b0"))) == ["c1"]
    rows = {r["user"]: r for r in st.fair_share()}
    assert set(rows) == {"bob", "carol"} and rows["bob"]["level"][0] > rows["carol"]["level"][0]


def test_ties_keep_the_inner_order():
    # Three users with no usage yet: one level, so the queue is the plain FIFO queue, interleaved.
    st = core(profile("fifo"), gpus=1)
    st.handle(JobArrived("x", 0.0, job("x", "zed", 0.0)))  # holds the GPU
    arrivals = [("j1", "bob"), ("j2", "alice"), ("j3", "bob"), ("j4", "carol"), ("j5", "alice")]
    st.handle(*[JobArrived(j, 1.0 + i, job(j, u, 1.0 + i)) for i, (j, u) in enumerate(arrivals)])
    assert [r.job.id for r in st.queue()] == ["j1", "j2", "j3", "j4", "j5"]


def test_the_report_gives_slurms_factor():
    st = core(profile("fifo", half_life_s=0), gpus=2)
    st.handle(JobArrived("a", 0.0, job("a", "alice", 0.0)), JobArrived("b", 0.0, job("b", "bob", 0.0, gpus=1)))
    st.handle(JobFinished("bf", 100.0, "b"), JobArrived("b2", 100.0, job("b2", "bob", 100.0)))
    st.handle(Tick("t", 300.0))
    rows = {r["user"]: r for r in st.fair_share()}
    # at 300 s alice has 300 GPU-s, bob 100 + 200: equal, so U/S = 1 and F = 1/2 each
    assert rows["alice"]["usage_gpu_s"] == pytest.approx(300.0) == rows["bob"]["usage_gpu_s"]
    assert rows["alice"]["factor"] == pytest.approx(0.5) and rows["alice"]["against_others"] == pytest.approx(1.0)
    assert SchedulerState("fifo").fair_share() == []


def _las_flood(prof) -> list[str]:
    st = core(prof, gpus=2)
    st.handle(*[JobArrived(f"f{i}", 0.0, job(f"f{i}", "flood", 0.0)) for i in range(2)])
    st.handle(*[JobArrived(f"f{i}", 4 * H, job(f"f{i}", "flood", 4 * H)) for i in (2, 3)])
    out = st.handle(JobArrived("b", 4 * H + 1, job("b", "bob", 4 * H + 1)), Tick("t", 4 * H + 2))
    assert len([d for d in out if isinstance(d, Preempt)]) == 2  # the two that ran 4 h make room
    return sorted(placed(out))


def test_a_preemptive_order_puts_the_other_user_ahead_of_the_floods_newcomers():
    assert _las_flood(profile("las")) == ["b", "f2"]
    assert _las_flood(load_profile("las")) == ["f2", "f3"]  # LAS alone: equal service, arrival order


# ---------------------------------------------------------------- no owners, no change


def _events(seed: int, users: tuple[str, ...]):
    rng = random.Random(seed)
    t, out, live = 0.0, [], []
    for k in range(120):
        t += rng.uniform(1.0, 900.0)
        if rng.random() < 0.55 or not live:
            j = f"j{k}"
            live.append(j)
            out.append(JobArrived(f"e{k}", t, Job(j, rng.choice(["ResNet-18", "LM"]), 32, gpus=rng.choice([1, 1, 2, 4]),
                                                 arrival=t, user=rng.choice(users))))
        elif rng.random() < 0.7:
            out.append(JobFinished(f"e{k}", t, live.pop(rng.randrange(len(live)))))
        else:
            out.append(Tick(f"e{k}", t))
    return out


def _decisions(prof, evs) -> list[dict]:
    st = SchedulerState(prof, [Node(f"n{i}", 4, 16, 64 * GiB) for i in range(2)], rng=random.Random(1))
    return [decision_to_dict(d) for e in evs for d in st.handle_batch([e])[0]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), order=st.sampled_from(["fifo", "las", "tiresias"]))
def test_one_owner_decides_exactly_as_no_fair_share(seed, order):
    evs = _events(seed, ("solo",))
    assert _decisions(profile(order), evs) == _decisions(load_profile(order), evs)


def test_several_owners_change_the_decisions_somewhere():
    evs = _events(3, ("a", "b", "c"))
    assert _decisions(profile("fifo"), evs) != _decisions(load_profile("fifo"), evs)


def test_explaining_between_events_changes_no_later_decision():
    evs = _events(5, ("a", "b", "c"))
    prof = profile("las")
    plain = _decisions(prof, evs)
    st = SchedulerState(prof, [Node(f"n{i}", 4, 16, 64 * GiB) for i in range(2)], rng=random.Random(1))
    got = []
    for e in evs:
        got += [decision_to_dict(d) for d in st.handle_batch([e])[0]]
        for r in list(st.waiting.values())[:3]:  # what an API or the extender asks between events
            st.explain(r.job), st.queue(), st.fair_share()
    assert got == plain


# ---------------------------------------------------------------- replay: simulator, snapshot, codec


def _owned_trace():
    rows = ["job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s,user,account"]
    rng = random.Random(4)
    for i in range(60):
        flood = i % 3 == 0
        at = 1000.0 * (i // 10) if flood else 600.0 * i
        rows.append(f"{i},{at},ResNet-18,32,{rng.choice([1, 2])},100,{rng.uniform(600, 6 * H):.1f},"
                    f"{'flood' if flood else 'u' + str(i % 4)},{'lab' if flood else ''}")
    return parse_trace("\n".join(rows) + "\n", "owned.csv")


def test_the_trace_carries_owners_and_the_simulator_replays_them_exactly():
    trace = _owned_trace()
    assert trace[0].user and {t.account for t in trace} == {"", "lab"}
    prof = profile("tiresias")
    a = simulate(trace, Cluster.parse("2x2"), prof, seed=0)
    b = simulate(trace, Cluster.parse("2x2"), prof, seed=0)
    assert a.job_ids == b.job_ids and (a.jct_s == b.jct_s).all() and a.preemptions == b.preemptions
    anon = [replace(t, user="", account="") for t in trace]
    c = simulate(anon, Cluster.parse("2x2"), prof, seed=0)
    d = simulate(anon, Cluster.parse("2x2"), load_profile("tiresias"), seed=0)
    assert (c.jct_s == d.jct_s).all() and c.job_ids == d.job_ids  # no owners: fair share changes nothing
    assert not (a.jct_s.mean() == c.jct_s.mean() and a.job_ids == c.job_ids)


def test_a_snapshot_carries_usage_and_levels():
    prof = profile("las", half_life_s=H)
    evs = _events(9, ("a", "b", "c"))
    head, tail = evs[:70], evs[70:]
    live = SchedulerState(prof, [Node(f"n{i}", 4, 16, 64 * GiB) for i in range(2)], rng=random.Random(1))
    for e in head:
        live.handle_batch([e])
    data = snapshot.dump(live)
    assert snapshot.header(data)["version"] == snapshot.VERSION == 5
    back = snapshot.load(data, profile("las", half_life_s=H))
    assert back.ledger.owners.usage == live.ledger.owners.usage and back.ledger.fair.held == live.ledger.fair.held
    assert back.fair_share() == live.fair_share()
    rest = [[decision_to_dict(d) for d in s.handle_batch([e])[0]] for s in (live, back) for e in tail]
    assert rest[:len(tail)] == rest[len(tail):]
    with pytest.raises(snapshot.SnapshotError):  # another half-life is another policy
        snapshot.load(data, profile("las", half_life_s=2 * H))


def test_owners_round_trip_through_the_codec():
    ev = JobArrived("e", 1.0, job("j", "alice", 1.0, account="vision"))
    back = event_from_dict(event_to_dict(ev))
    assert back == ev and back.job.user == "alice" and back.job.account == "vision"
    old = event_to_dict(JobArrived("e", 1.0, Job("j", "m")))
    del old["job"]["user"], old["job"]["account"]  # logged before jobs had owners
    assert event_from_dict(old).job.user == "" == event_from_dict(old).job.account
    with pytest.raises(ValueError):
        Job("j", "m", user=7)


@pytest.mark.parametrize("bad, key", [
    ({"enabled": "yes"}, "fairshare.enabled"), ({"half_life_s": -1}, "fairshare.half_life_s"),
    ({"shares": {"alice": 0}}, "fairshare.shares.alice"), ({"tolerance": 0.5}, "fairshare.tolerance"),
    ({"weight": 1}, "unknown [fairshare] keys"), ({"shares": []}, "fairshare.shares must be a table"),
])
def test_bad_fairshare_tables_are_named(bad, key):
    with pytest.raises(ProfileError, match="x.toml.*" + key.replace("[", r"\[").replace("]", r"\]")):
        parse_profile({"order": "fifo", "fairshare": bad}, "x.toml")


def test_trace_owner_columns_are_optional_and_bounded():
    base = "job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s"
    assert parse_trace(base + "\n1,0,ResNet-18,32,1,10,60\n")[0].user == ""
    assert parse_trace(base + ",user\n1,0,ResNet-18,32,1,10,60,bob\n")[0].user == "bob"
    with pytest.raises(ValueError, match="row 2: column user"):
        parse_trace(base + ",user\n1,0,ResNet-18,32,1,10,60," + "x" * 300 + "\n")
    assert TraceJob("1", 0, "m", 0, 1, 0, 1.0).account == ""
