"""Snapshots: a core restored from one decides exactly as the core it was taken from, and a
snapshot of another profile, version or a damaged one is refused with a reason."""

import random

import pytest

from scheduler import (
    Job, JobArrived, JobFinished, JobStarted, Node, NodeReport, PlacementFailed, SchedulerState, Tick, WatchRules,
    load_profile,
)
from scheduler import snapshot
from scheduler.codec import decision_to_dict
from scheduler.model import GiB
from scheduler.replay import differences, replay

RULES = WatchRules(backoff_s=1.0, vanish_after_s=10.0)


def events(seed: int, n: int, t0: float = 0.0):
    """A random run: node reports, arrivals of GPU and CPU jobs, starts, finishes, failures, ticks."""
    rng = random.Random(seed)
    out, t, jobs = [], t0, []
    for i in range(4):
        out.append(NodeReport(f"{seed}-r{i}", t, Node(f"n{i}", 4, 16, 64 * GiB)))
    for k in range(n):
        t += rng.uniform(0.1, 30.0)
        x = rng.random()
        sid = f"{seed}-e{k}"
        if x < 0.45 or not jobs:
            j = f"{seed}-j{k}"
            jobs.append(j)
            job = (Job(j, "prep", gpus=0, cpus=rng.choice([1.0, 2.0, 4.0]), memory_bytes=GiB) if rng.random() < 0.3
                   else Job(j, rng.choice(["ResNet-18", "LM", "Transformer"]), 32, gpus=rng.choice([1, 1, 2, 4])))
            out.append(JobArrived(sid, t, job))
        elif x < 0.65:
            out.append(JobStarted(sid, t, rng.choice(jobs), f"n{rng.randrange(4)}"))
        elif x < 0.85:
            out.append(JobFinished(sid, t, rng.choice(jobs)))
        elif x < 0.9:
            out.append(PlacementFailed(sid, t, rng.choice(jobs), "refused"))
        elif x < 0.95:
            out.append(NodeReport(sid, t, Node(f"n{rng.randrange(4)}", 4, 16, 64 * GiB), running=()))
        else:
            out.append(Tick(sid, t))
    return out


def run(state, evs):
    out = []
    for i, e in enumerate(evs):
        out += [decision_to_dict(d) for d in state.handle_batch([e])[0]]
    return out


@pytest.mark.parametrize("profile", ["fifo", "dlshare", "tiresias"])
def test_a_restored_core_decides_as_the_original(profile):
    evs = events(7, 300)
    head, tail = evs[:150], evs[150:]
    a = SchedulerState(profile, rules=RULES, rng=random.Random(3))
    run(a, head)
    a.compact()
    data = snapshot.dump(a, {"batch": 150})
    b = snapshot.load(data, load_profile(profile), RULES)
    assert snapshot.header(data)["batch"] == 150
    got = run(b, tail)
    assert got == run(a, tail)
    kinds = {d["type"] for d in got}
    assert len(got) > 50 and {"Place", "Allocate", "Release"} <= kinds, kinds


def test_replay_matches_a_recorded_run_and_names_the_first_difference():
    evs = events(11, 200)
    live = SchedulerState("dlshare", rules=RULES)
    recorded = {i: [decision_to_dict(d) for d in live.handle_batch([e])[0]] for i, e in enumerate(evs)}
    again = SchedulerState("dlshare", rules=RULES)
    assert differences(recorded, replay(again, list(enumerate([e] for e in evs)))) == []
    other = SchedulerState("spread", rules=RULES)  # another policy departs somewhere, and says where
    diff = differences(recorded, replay(other, list(enumerate([e] for e in evs))))
    assert diff and diff[0].startswith("batch ") and "differs" in diff[0]


def test_snapshots_of_another_profile_version_or_damaged_are_refused():
    st = SchedulerState("fifo", rules=RULES)
    data = snapshot.dump(st)
    with pytest.raises(snapshot.SnapshotError, match="profile 'fifo'"):
        snapshot.load(data, load_profile("las"), RULES)
    with pytest.raises(snapshot.SnapshotError, match="other settings"):
        snapshot.load(data, load_profile("fifo"), WatchRules())
    with pytest.raises(snapshot.SnapshotError, match="damaged"):
        snapshot.load(data[:-20])
    with pytest.raises(snapshot.SnapshotError, match="not a dlshare"):
        snapshot.load(b"garbage")
    bumped = data.replace(f'"version": {snapshot.VERSION}'.encode(), b'"version": 99')
    with pytest.raises(snapshot.SnapshotError, match="format 99"):
        snapshot.load(bumped)
    assert isinstance(snapshot.load(data, load_profile("fifo"), RULES), SchedulerState)
