"""The Slurm shell against an in-memory Slurm (fake_slurm.py): translation, idempotence, restarts.

The same behaviours run against the real Slurm in test_slurm_live.py and test_slurm_faults.py;
here they are driven with a fake clock, step by step, including a crash between any two commands.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SchedulerState, load_profile
from scheduler.model import JobState
from scheduler.slurm.shell_log import ShellLog, ShellLogError
from scheduler.slurm.plan import restore_commands
from scheduler.slurm.shell import SlurmShell, release_held
from scheduler.slurm.squeue import parse_job
from tests.scheduler.slurm.fake_slurm import Crash, FakeSlurm

LAS_FAST = """name = "las-fast"
[order]
plugin = "las"
args = { quantum_s = 2.0 }
[placement]
share = "never"
[[score]]
plugin = "consolidate"
[allocate]
plugin = "proportional"
"""

PACK = """name = "pack"
[order]
plugin = "fifo"
[placement]
share = "when_full"
max_share = 2
[[score]]
plugin = "consolidate"
[allocate]
plugin = "proportional"
"""


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_shell(slurm: FakeSlurm, journal: Path, profile="fifo", clock=None, tmp=None, **kw) -> SlurmShell:
    if isinstance(profile, str) and "\n" in profile:
        p = Path(tmp or journal.parent) / "profile.toml"
        p.write_text(profile)
        profile = load_profile(p)
    core = SchedulerState(profile)
    sh = SlurmShell(core, "dlshare", journal, slurm, clock=clock or Clock(), fsync=False, retry_s=5.0,
                    gpu_slots=slurm.slots, **kw)
    sh.recover()
    return sh


def job(slurm: FakeSlurm, jid: str):
    return parse_job(slurm.jobs[jid])


def test_placement_cpu_memory_and_binding(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=4)
    a = slurm.submit("ResNet-50@64", gpus=1)
    b = slurm.submit(comment="model=LM batch_size=20", gpus=4)
    sh = make_shell(slurm, tmp_path / "j")
    acts = sh.step()
    assert [x.kind for x in acts] == ["release", "release"]
    for jid in (a, b):
        rec = sh.core.records[jid]
        j = job(slurm, jid)
        (shard,) = rec.shards
        alloc = rec.allocation[shard.node]
        assert j.required_nodes == (shard.node,)
        assert j.cpus == int(alloc.cpus) and j.memory_mb == alloc.memory_bytes >> 20
        assert j.admin_comment == f"dlshare {shard.node}={','.join(map(str, shard.gpus))}"
        assert "| dlshare: placed on" in j.comment or j.comment.startswith("dlshare: placed on")
        assert not j.held
    assert sh.core.records[a].job.model == "ResNet-50" and sh.core.records[a].job.batch_size == 64
    assert sh.core.records[b].job.gpus == 4
    assert sorted(slurm.schedule()) == [a, b]
    assert sh.step() == []  # level-triggered: nothing left to do, nothing done twice
    assert len(sh.stats.latency_s) == 2
    slurm.finish(a)
    sh.step()
    assert sh.core.records[a].job.state is JobState.DONE


def test_colocated_job_gets_the_same_gpu_and_a_slot(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=2)
    a, b = slurm.submit("ResNet-18@32"), slurm.submit("ResNet-18@32")
    sh = make_shell(slurm, tmp_path / "j", PACK)
    sh.step()
    assert slurm.schedule() == [a, b]
    ja, jb = job(slurm, a), job(slurm, b)
    assert ja.admin_comment == jb.admin_comment == "dlshare n1=0"
    assert "shared with" in jb.comment
    assert sh.core.records[b].job.state is JobState.RUNNING
    c = slurm.submit("ResNet-18@32")
    sh.clock.t += 11  # reasons are refreshed every status_s (10 s)
    sh.step()
    assert job(slurm, c).held and "waiting" in job(slurm, c).comment


def test_preemption_requeues_held_then_places_again(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=2)
    clock = Clock()
    a, b = slurm.submit("A", gpus=1), slurm.submit("B", gpus=1)
    sh = make_shell(slurm, tmp_path / "j", LAS_FAST, clock)
    sh.step()
    slurm.schedule()
    clock.t += 10
    c = slurm.submit("C", gpus=1)
    sh.step()  # C arrives and waits; the core asks for a Tick one quantum (2 s) later
    clock.t += 3
    acts = sh.step()  # the Tick: LAS preempts the job with the most service for C
    kinds = [x.kind for x in acts]
    assert kinds[0] == "requeue" and "release" in kinds, kinds
    victim = acts[0].job
    assert victim in (a, b)
    v = job(slurm, victim)
    assert v.held and v.restart_count == 1 and "preempted" in v.comment
    assert slurm.schedule() == [c]
    for _ in range(6):  # LAS rotates: the victim runs again later
        clock.t += 3
        sh.step()
        slurm.schedule()
    assert slurm.starts[victim] >= 2
    assert sh.stats.preempts >= 1


def test_slurm_requeue_is_held_and_placed_again(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=1, slots=1)
    a = slurm.submit("A")
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    slurm.schedule()
    slurm.requeue_by_slurm(a)  # e.g. an admin's scontrol requeue: pending, not held
    acts = sh.step()
    assert [x.kind for x in acts] == ["release"]  # the core re-placed it at once: placement again
    assert job(slurm, a).required_nodes and slurm.schedule() == [a]
    assert slurm.starts[a] == 2


def test_a_release_slurm_never_starts_is_placed_again(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=1, slots=1)
    clock = Clock()
    a = slurm.submit("A")
    sh = make_shell(slurm, tmp_path / "j", clock=clock)
    sh.step()
    first = job(slurm, a).required_nodes
    slurm.nodes[first[0]]["real_memory"] = 1  # Slurm's view of the node differs: it will not start there
    assert slurm.schedule() == []
    clock.t += 60
    sh.step()
    assert job(slurm, a).required_nodes == first  # still within start_timeout_s (120 s)
    clock.t += 61
    sh.step()  # placed again (the core remembers nothing against the node; it may pick either)
    assert sh.stats.refused == 0 and sh.core.records[a].job.state is JobState.RUNNING
    assert sum(1 for c in slurm.commands if c[1] == "update" and any(x.startswith("NodeList=") for x in c)) == 2
    slurm.nodes[first[0]]["real_memory"] = 256000
    assert slurm.schedule() == [a]


def test_node_down_requeues_and_places_elsewhere(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=1, slots=1)
    a = slurm.submit("A")
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    slurm.schedule()
    node = job(slurm, a).nodes[0]
    slurm.nodes[node]["state"] = "down"
    slurm.requeue_by_slurm(a)
    sh.step()
    other = next(n for n in slurm.nodes if n != node)
    assert job(slurm, a).required_nodes == (other,)
    assert slurm.schedule() == [a]
    assert not sh.core.nodes[node].alive
    slurm.nodes[node]["state"] = "idle"
    sh.step()
    assert sh.core.nodes[node].alive


def test_bad_comment_held_with_reason_then_fixed(tmp_path):
    slurm = FakeSlurm()
    bad = slurm.submit(comment="model=LM bs=many", held=False)  # escaped the hold, too
    sh = make_shell(slurm, tmp_path / "j")
    acts = sh.step()
    assert [x.kind for x in acts] == ["hold"]
    j = job(slurm, bad)
    assert j.held and "not scheduled: bad job fields: bs='many'" in j.comment
    assert bad not in sh.core.records
    slurm.jobs[bad]["comment"] = "model=LM bs=8"  # the user fixes it
    sh.step()
    assert sh.core.records[bad].job.batch_size == 8 and not job(slurm, bad).held


def test_cpu_only_and_shard_jobs_are_not_taken(tmp_path):
    slurm = FakeSlurm()
    cpu = slurm.submit("LM@2", gpus=0)
    shard = slurm.submit("LM@2", tres_per_node="gres:shard:2")
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    assert "asks for no GPU" in job(slurm, cpu).comment and "gres/shard" in job(slurm, shard).comment
    assert not sh.core.records


def test_unplaceable_job_stays_held_with_the_core_reason(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=4)
    big = slurm.submit("LM@20", gpus=16)
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    j = job(slurm, big)
    assert j.held and "cannot run: needs 16 GPUs, the cluster has 8" in j.comment
    wait = slurm.submit("LM@20", gpus=4)
    slurm.submit("LM@20", gpus=4)
    sh.step()
    slurm.schedule()
    third = slurm.submit("LM@20", gpus=4)
    sh.clock.t += 11
    sh.step()
    assert "waiting (Resources): needs 4 GPUs; 0 free" in job(slurm, third).comment, job(slurm, third).comment
    assert not job(slurm, wait).held


def test_cancelled_and_vanished_jobs_end_in_the_core(tmp_path):
    slurm = FakeSlurm()
    a, b = slurm.submit("A"), slurm.submit("B", gpus=16)
    c = slurm.submit("C")
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    slurm.schedule()
    slurm.jobs[a]["job_state"] = "CANCELLED"
    del slurm.jobs[c]  # purged by Slurm (MinJobAge) while dlshare was not looking
    sh.step()
    assert sh.core.records[a].job.state is JobState.FAILED
    assert sh.core.records[c].job.state is JobState.DONE
    assert sh.core.records[b].job.state is JobState.FAILED  # rejected: can never run


def test_restart_rebuilds_the_same_state_and_releases_nothing_twice(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=2)
    ids = [slurm.submit(f"J{i}") for i in range(6)]
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    before = {j: (r.job.state, r.shards) for j, r in sh.core.records.items()}
    n_cmds = len(slurm.commands)
    sh2 = make_shell(slurm, tmp_path / "j")  # a new process on the same journal
    assert {j: (r.job.state, r.shards) for j, r in sh2.core.records.items()} == before
    sh2.step()
    assert len(slurm.commands) == n_cmds  # Slurm already shows every release: nothing is sent again
    assert slurm.schedule() == ids[:4]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 60), st.integers(0, 3))
def test_kill_between_any_two_commands_loses_and_doubles_nothing(crash_at, finish_every):
    """FIFO, 8 jobs on 2x2 GPUs; the shell dies before its crash_at-th scontrol call and restarts."""
    with tempfile.TemporaryDirectory() as d:
        slurm = FakeSlurm(nodes=2, gpus=2, slots=1)
        ids = [slurm.submit(f"J{i}") for i in range(8)]
        journal = Path(d) / "j"
        sh = make_shell(slurm, journal)
        slurm.crash_after = crash_at
        crashed = False
        for rnd in itertools.count():
            assert rnd < 200, "did not finish"
            try:
                sh.step()
            except Crash:
                assert not crashed
                crashed = True
                slurm.crash_after = None
                sh = make_shell(slurm, journal)
                continue
            slurm.schedule()
            running = [j for j in ids if slurm.jobs[j]["job_state"] == "RUNNING"]
            for j in running[: finish_every + 1]:
                slurm.finish(j)
            if all(slurm.jobs[j]["job_state"] == "COMPLETED" for j in ids):
                break
        assert all(slurm.starts[j] == 1 for j in ids), slurm.starts  # none lost, none run twice
        sh.step()
        assert all(sh.core.records[j].job.state is JobState.DONE for j in ids)


def test_journal_torn_last_line_is_dropped_other_damage_is_an_error(tmp_path):
    p = tmp_path / "j"
    j = ShellLog(p)
    j.append({"t": "hdr", "v": 1})
    j.append({"t": "job", "id": "1"})
    j.close()
    with open(p, "ab") as f:
        f.write(b'{"t": "ev", "ev": {"ty')
    assert [r["t"] for r in ShellLog(p).load()] == ["hdr", "job"]
    assert p.read_bytes().endswith(b"}\n")  # the torn tail is cut off
    with open(p, "ab") as f:
        f.write(b"garbage\n" + b'{"t": "job", "id": "2"}\n')
    with pytest.raises(ShellLogError, match="line 3"):
        ShellLog(p).load()


def test_journal_of_another_partition_or_profile_is_refused(tmp_path):
    slurm = FakeSlurm()
    make_shell(slurm, tmp_path / "j").close()
    with pytest.raises(ShellLogError, match="profile"):
        make_shell(slurm, tmp_path / "j", profile="las")


def test_jobs_sharing_a_gpu_get_longer_time_limits_and_no_one_else(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=2, slots=2)
    a = slurm.submit("ResNet-18@32", time_limit=30)
    sh = make_shell(slurm, tmp_path / "j", PACK)
    sh.step()
    assert slurm.schedule() == [a]
    b, c, d = (slurm.submit("ResNet-18@32", time_limit=30), slurm.submit("ResNet-18@32", time_limit=30),
               slurm.submit("ResNet-18@32"))
    sh.clock.t += 1
    sh.step()
    slurm.schedule()
    shards = {j: sh.core.records[j].shards[0] for j in (a, b, c, d)}
    shared = {j for j in shards if sum(shards[o] == shards[j] for o in shards) > 1}
    assert len(shared) == 4 and d in shared  # 4 jobs on 2 GPUs
    release_b = next(cmd for cmd in slurm.commands if cmd[:3] == ("scontrol", "update", f"JobId={b}"))
    limit_b = int(next(x for x in release_b if x.startswith("TimeLimit="))[10:])
    assert 60 <= limit_b <= 120  # the newcomer's release carries its longer limit
    assert job(slurm, b).time_limit_min == limit_b and "while shared" in job(slurm, b).comment
    assert 60 <= job(slurm, a).time_limit_min <= 120  # the resident, running already, in the same step
    assert job(slurm, d).time_limit_min is None  # no limit: nothing to extend
    n = len(slurm.commands)
    sh.clock.t += 20
    sh.step()  # level-triggered: done once, not again
    assert not [cmd for cmd in slurm.commands[n:] if any(x.startswith("TimeLimit=") for x in cmd)]


def test_a_job_alone_on_its_gpus_keeps_its_time_limit(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=2, slots=2)
    a, b = slurm.submit("LM@20", gpus=2, time_limit=30), slurm.submit("ResNet-18@32", time_limit=30)
    sh = make_shell(slurm, tmp_path / "j")  # fifo: no sharing
    sh.step()
    slurm.schedule()
    sh.clock.t += 20
    sh.step()
    assert job(slurm, a).time_limit_min == 30 and job(slurm, b).time_limit_min == 30
    assert not [cmd for cmd in slurm.commands if any(x.startswith("TimeLimit=") for x in cmd)]


def test_release_held_gives_jobs_their_own_request_back(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=1)
    a, b = slurm.submit("A", cpus=3, memory_per_node=64000), slurm.submit("B", cpus=2, memory_per_node=1000)
    sh = make_shell(slurm, tmp_path / "j")
    sh.step()
    sh.close()
    slurm.schedule()
    assert job(slurm, b).held  # waiting for the one GPU
    done, failed = release_held(slurm, "dlshare", tmp_path / "j")
    assert (done, failed) == (1, 0)
    jb = job(slurm, b)
    assert not jb.held and jb.cpus == 2 and jb.memory_mb == 1000 and jb.comment == "" and jb.admin_comment == ""
    cmds = restore_commands(jb, None)
    assert cmds[0][:3] == ("scontrol", "update", f"JobId={b}") and len(cmds) == 1


def test_release_held_gives_a_job_its_own_time_limit_back(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=2)
    a = slurm.submit("ResNet-18@32", time_limit=30)
    sh = make_shell(slurm, tmp_path / "j", PACK)
    sh.step()
    slurm.schedule()
    b = slurm.submit("ResNet-18@32", time_limit=30)
    sh.clock.t += 1
    sh.step()  # b's release sets a longer limit; Slurm has not started it yet
    sh.close()
    assert job(slurm, b).time_limit_min > 30 and job(slurm, a).time_limit_min > 30
    slurm.jobs[b].update(priority=0)  # held again before it started (an operator's hold)
    release_held(slurm, "dlshare", tmp_path / "j")
    assert job(slurm, b).time_limit_min == 30 and not job(slurm, b).held


class FakeFeed:
    """TelemetryFeed's face: the latest telemetry per node, with its receive time."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[dict, float]] = {}

    def take(self, since):
        return {n: v for n, v in self.latest.items() if v[1] > since.get(n, float("-inf"))}

    def stop(self) -> None:
        pass


def test_telemetry_becomes_node_reports_at_most_every_telemetry_s(tmp_path):
    from nodesvc.bus.messages import telemetry_from
    from scheduler.slurm.telemetry import report_fields

    payload = {"node": "n1", "ts": 1.0, "cpu": {"count": 12, "percent": 37.5}, "rdma": {},
               "memory": {"total_bytes": 10, "available_bytes": 7},
               "gpus": {"devices": [{"index": 0, "util_percent": 80}, {"index": 1, "util_percent": None}, "junk"]}}
    fields = report_fields(telemetry_from(payload))
    assert fields == {"gpu_util": (80.0,), "cpu_percent": 37.5, "memory_available_bytes": 7}
    slurm = FakeSlurm(nodes=2)
    feed = FakeFeed()
    clock = Clock()
    sh = make_shell(slurm, tmp_path / "j", clock=clock, telemetry=feed, telemetry_s=30.0)
    sh.step()  # nodes registered from Slurm
    feed.latest["n1"] = (fields, 1.0)
    feed.latest["ghost"] = (fields, 1.0)  # a node daemon whose id is no Slurm node: ignored
    sh.step()
    assert sh.core.nodes["n1"].cpu_percent == 37.5 and sh.core.nodes["n1"].gpu_util == (80.0,)
    feed.latest["n1"] = ({**fields, "cpu_percent": 90.0}, 2.0)
    clock.t += 5
    sh.step()
    assert sh.core.nodes["n1"].cpu_percent == 37.5  # too soon after the last report
    clock.t += 30
    sh.step()
    assert sh.core.nodes["n1"].cpu_percent == 90.0
    # the reports are journaled events: a restart rebuilds the same figures
    sh2 = make_shell(slurm, tmp_path / "j", clock=clock)
    assert sh2.core.nodes["n1"].cpu_percent == 90.0


def test_predictor_cache_builds_once_per_key(tmp_path):
    from scheduler.slurm.cache import cached, data_key

    built = []

    def build():
        built.append(1)
        return {"model": len(built)}

    f = tmp_path / "data.csv"
    f.write_text("x")
    key = data_key([f])
    p = tmp_path / "j.predictors"
    assert cached(p, key, build) == {"model": 1}
    assert cached(p, key, build) == {"model": 1} and len(built) == 1  # a restart loads it
    assert oct(p.stat().st_mode & 0o777) == "0o600"
    f.write_text("changed data")
    assert cached(p, data_key([f]), build) == {"model": 2}  # new data: trained again
    p.write_bytes(b"not a pickle")
    assert cached(p, data_key([f]), build) == {"model": 3}  # damaged: trained again, never fatal
