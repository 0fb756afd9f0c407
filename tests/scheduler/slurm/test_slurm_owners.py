"""A Slurm job's owner (user_name, account) reaches the core: parsing, fuzzing, fair share and quotas.

Against the in-memory Slurm (fake_slurm.py), with a fake clock; test_slurm_live.py runs the same
against the real Slurm with jobs of two local users.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SchedulerState, load_profile
from scheduler.model import MAX_OWNER, Job, JobState
from scheduler.slurm.shell import SlurmShell
from scheduler.slurm.squeue import SlurmJsonError, job_owner, parse_job, parse_jobs
from tests.scheduler.slurm.fake_slurm import FakeSlurm
from tests.scheduler.slurm.slurm_json import job_json

BASE = """name = "{name}"
[order]
plugin = "fifo"
[placement]
share = "never"
backfill = true
[[score]]
plugin = "consolidate"
[allocate]
plugin = "proportional"
"""

QUOTA = BASE.format(name="fifo-quota") + """
[quota.default_user]
gpus = 2
[quota.accounts.vision]
gpus = 1
"""

FAIR = BASE.format(name="fifo-fair") + """
[fairshare]
enabled = true
half_life_s = 0
"""


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_shell(slurm: FakeSlurm, tmp: Path, profile: str = "fifo", clock=None, journal: str = "j") -> SlurmShell:
    if "\n" in profile:
        (tmp / "profile.toml").write_text(profile)
        profile = load_profile(tmp / "profile.toml")
    sh = SlurmShell(SchedulerState(profile), "dlshare", tmp / journal, slurm, clock=clock or Clock(), fsync=False,
                    retry_s=5.0, status_s=0.0, gpu_slots=slurm.slots)
    sh.recover()
    return sh


def owner(sh: SlurmShell, jid: str) -> tuple[str, str]:
    j = sh.core.records[jid].job
    return j.user, j.account


# ------------------------------------------------------------------ parsing


def test_slurm_22_05_shape():
    # as the installed slurm-wlm 22.05 writes them (squeue --json, openapi/v0.0.38)
    j = parse_job(job_json(5, user_name="alice", user_id=1000, group_name="alice", account="vision"))
    assert (j.user, j.account, j.owner_note) == ("alice", "vision", "")
    j = parse_job(job_json(6, user_name="nobody", user_id=65534, account=""))
    assert (j.user, j.account, j.owner_note) == ("nobody", "", "")
    assert parse_job(job_json(7, account="(null)")).account == ""  # squeue -o %a's spelling of none


def test_later_shapes_and_sacct_shape():
    assert job_owner({"user_name": "bob", "user_id": {"set": True, "infinite": False, "number": 7}}) == ("bob", "", "")
    assert job_owner({"user": "carol", "account": "nlp"}) == ("carol", "nlp", "")  # sacct --json's key


@pytest.mark.parametrize("rec,user,account,words", [
    ({"user_id": 1234}, "1234", "", "no user_name: counted as user '1234'"),
    ({"user_name": "", "user_id": 1234}, "1234", "", "user_name is empty"),
    ({"user_name": "nobody", "user_id": 1234}, "1234", "", "the uid has no name on this host"),
    ({"user_name": "a\nb", "user_id": 9}, "9", "", "control characters"),
    ({"user_name": "x" * (MAX_OWNER + 1), "user_id": 9}, "9", "", f"more than {MAX_OWNER}"),
    ({"user_name": 42, "user_id": 9}, "9", "", "not text: int"),
    ({"user_name": None}, "", "", "no usable user_id (None): counted as the anonymous user"),
    ({}, "", "", "no user_name, and no usable user_id"),
    ({"user_name": ["a"], "user_id": -1}, "", "", "no usable user_id (-1)"),
    ({"user_name": "dan", "user_id": 5, "account": ["vision"]}, "dan", "", "account ['vision'] (not text: list): "
                                                                             "counted as no account"),
    ({"user_name": "dan", "account": "a" * 300}, "dan", "", "counted as no account"),
])
def test_odd_owners_fall_back_and_say_so(rec, user, account, words):
    u, a, note = job_owner(rec)
    assert (u, a) == (user, account)
    assert words in note, note


owner_values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 1 << 34), st.floats(allow_nan=True), st.text(max_size=300),
    st.sampled_from(["", "(null)", "nobody", "root", " alice ", "x" * MAX_OWNER, "x" * (MAX_OWNER + 1)]),
    st.lists(st.text(max_size=4), max_size=2), st.dictionaries(st.sampled_from(["set", "number", "infinite"]),
                                                                st.one_of(st.booleans(), st.integers(-2, 1 << 33))))
owner_keys = ["user_name", "user_id", "account", "user"]


def _checked(j) -> None:
    """What the core needs of an owner, and a note whenever Slurm's own value was not taken."""
    Job(id=j.job_id, model="m", user=j.user, account=j.account)  # raises if the core would refuse it
    assert j.user == j.user.strip() and j.account == j.account.strip()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(owner_keys), owner_values, max_size=4))
def test_fuzzed_owners_never_make_a_job_unreadable(over):
    rec = {k: v for k, v in job_json(3).items() if k not in owner_keys}
    rec.update(over)
    j = parse_job(rec)  # never SlurmJsonError for an owner: the job is read, its owner falls back
    _checked(j)
    name = over.get("user_name", over.get("user"))
    if not j.owner_note:
        assert j.user == name.strip() and j.user
    elif isinstance(name, str) and name.strip() not in ("", "(null)", "nobody") and len(name.strip()) <= MAX_OWNER \
            and not any(ord(c) < 32 or ord(c) == 127 for c in name):
        assert j.user == name.strip()  # the note is about the account only


@settings(max_examples=150, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(owner_keys), owner_values, max_size=4), min_size=1, max_size=6),
       st.integers(0, 6))
def test_fuzzed_payload_loses_no_job_and_bad_shapes_are_clear_errors(owners, broken_at):
    jobs = [{**job_json(i + 1), **o} for i, o in enumerate(owners)]
    got = parse_jobs(json.dumps({"jobs": jobs}))  # odd owners alone: every job is there, in order
    assert [j.job_id for j in got] == [str(i + 1) for i in range(len(owners))]
    for j in got:
        _checked(j)
    if broken_at < len(jobs):  # a record of the wrong shape elsewhere: one clear error, never a shorter list
        jobs[broken_at] = {**jobs[broken_at], "cpus": "many"}
        with pytest.raises(SlurmJsonError, match=f"job {broken_at + 1}: cpus"):
            parse_jobs({"jobs": jobs})


# ------------------------------------------------------------------ the shell


def test_owners_reach_the_core_and_quotas_apply_per_user_and_account(tmp_path):
    slurm = FakeSlurm(nodes=2, gpus=4, slots=1)  # 8 GPUs: every wait below is a quota, not a full cluster
    a1, a2, a3 = (slurm.submit("LM@8", user_name="alice", user_id=1001) for _ in range(3))
    b1 = slurm.submit("LM@8", user_name="bob", user_id=1002)
    v1, v2 = (slurm.submit("LM@8", user_name="carol", user_id=1003, account="vision") for _ in range(2))
    sh = make_shell(slurm, tmp_path, QUOTA)
    sh.step()
    assert owner(sh, a1) == ("alice", "") and owner(sh, b1) == ("bob", "") and owner(sh, v1) == ("carol", "vision")
    running = set(slurm.schedule())
    assert running == {a1, a2, b1, v1}, running  # alice at her 2 GPUs, vision at its 1
    for jid, words in ((a3, "user 'alice' holds 2 of its 2 GPUs (quota)"),
                       (v2, "account 'vision' holds 1 of its 1 GPUs (quota)")):
        j = parse_job(slurm.jobs[jid])
        assert j.held and words in j.comment, j.comment
    slurm.finish(a1)
    sh.step()
    assert slurm.schedule() == [a3]  # her next job starts when her other one ends


def test_without_owners_one_quota_holds_the_whole_partition(tmp_path):
    # what dlshare slurm did before it read owners, and still does for jobs without one: one anonymous user
    slurm = FakeSlurm(nodes=2, gpus=4, slots=1)
    ids = [slurm.submit("LM@8", user_name=None, user_id=None) for _ in range(4)]
    sh = make_shell(slurm, tmp_path, QUOTA)
    sh.step()
    assert [owner(sh, j) for j in ids] == [("", "")] * 4
    assert len(slurm.schedule()) == 2


@pytest.mark.parametrize("fair", [True, False])
def test_fair_share_puts_the_user_with_less_usage_first(tmp_path, fair):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=1)
    clock = Clock()
    sh = make_shell(slurm, tmp_path, FAIR if fair else BASE.format(name="fifo-plain"), clock)
    a1 = slurm.submit("LM@8", user_name="alice", user_id=1001)
    sh.step()
    assert slurm.schedule() == [a1]
    clock.t = slurm.now = 1010.0
    a2 = slurm.submit("LM@8", user_name="alice", user_id=1001)  # alice's next job comes first...
    clock.t = slurm.now = 1020.0
    b1 = slurm.submit("LM@8", user_name="bob", user_id=1002)  # ...bob's later, and he has used nothing
    sh.step()
    clock.t = slurm.now = 4600.0  # alice's job ran an hour
    slurm.finish(a1)
    sh.step()
    assert slurm.schedule() == ([b1] if fair else [a2])
    if fair:  # the owners' books: alice's hour on one GPU, bob nothing; alice on the higher level
        fs = {f["user"]: f for f in sh.core.fair_share()}
        assert fs["alice"]["usage_gpu_s"] == pytest.approx(3600.0) and fs["bob"]["usage_gpu_s"] == 0.0
        assert fs["alice"]["level"] > fs["bob"]["level"] == (0, 0)  # (account level, user level)


def test_odd_owner_is_logged_once_and_the_job_still_runs(tmp_path, caplog):
    slurm = FakeSlurm()
    odd = slurm.submit("LM@8", user_name="nobody", user_id=4242, account=7)
    sh = make_shell(slurm, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dlshare.slurm"):
        sh.step()
        sh.step()
    lines = [r.getMessage() for r in caplog.records if f"job {odd}:" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'nobody' for uid 4242" in lines[0] and "counted as user '4242'" in lines[0]
    assert "account 7 (not text: int): counted as no account" in lines[0]
    assert owner(sh, odd) == ("4242", "")
    assert slurm.schedule() == [odd]


def test_owner_changed_in_slurm_is_logged_once_not_followed(tmp_path, caplog):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=1)
    a = slurm.submit("LM@8", user_name="alice", user_id=1001)
    b = slurm.submit("LM@8", user_name="alice", user_id=1001, account="vision")
    sh = make_shell(slurm, tmp_path)
    sh.step()
    slurm.jobs[b]["account"] = "nlp"  # scontrol update JobId=b Account=nlp, while it waits
    with caplog.at_level(logging.WARNING, logger="dlshare.slurm"):
        for _ in range(3):
            sh.step()
    lines = [r.getMessage() for r in caplog.records if f"job {b}:" in r.getMessage()]
    assert len(lines) == 1 and "account 'nlp'" in lines[0] and "account 'vision'" in lines[0], lines
    assert owner(sh, b) == ("alice", "vision") and owner(sh, a) == ("alice", "")


def test_old_journal_without_owners_replays_as_anonymous(tmp_path, caplog):
    """A journal written before dlshare slurm read owners: its jobs come back as "" and keep running."""
    slurm = FakeSlurm(nodes=1, gpus=2, slots=1)
    a = slurm.submit("LM@8", user_name="alice", user_id=1001, account="vision")
    b = slurm.submit("LM@8", user_name="bob", user_id=1002)
    sh = make_shell(slurm, tmp_path)
    sh.step()
    assert slurm.schedule() == [a, b]
    sh.close()
    lines = (tmp_path / "j").read_text().splitlines()
    old = []
    for line in lines:  # strip the owner from every job, as the older writer wrote them
        rec = json.loads(line)
        job = rec.get("ev", {}).get("job")
        if isinstance(job, dict):
            assert job.pop("user") and "account" in job
            job.pop("account")
        old.append(json.dumps(rec))
    (tmp_path / "j").write_text("\n".join(old) + "\n")
    n_cmds = len(slurm.commands)
    sh2 = make_shell(slurm, tmp_path)
    assert owner(sh2, a) == ("", "") and owner(sh2, b) == ("", "")
    assert all(sh2.core.records[j].job.state is JobState.RUNNING for j in (a, b))
    with caplog.at_level(logging.WARNING, logger="dlshare.slurm"):
        sh2.step()
    assert len(slurm.commands) == n_cmds  # nothing redone
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"job {a}: Slurm shows user 'alice' account 'vision'" in said and f"job {b}:" in said
    c = slurm.submit("LM@8", user_name="carol", user_id=1003)
    slurm.finish(a)
    sh2.step()
    assert owner(sh2, c) == ("carol", "")  # new arrivals carry their owner
    assert slurm.schedule() == [c]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(owner_keys), owner_values, max_size=4), min_size=1, max_size=5))
def test_fuzzed_owners_through_the_shell_every_job_arrives(owners):
    with tempfile.TemporaryDirectory() as d:
        slurm = FakeSlurm(nodes=2, gpus=4, slots=1)
        ids = []
        for o in owners:
            jid = slurm.submit("LM@8")
            for k in owner_keys:
                slurm.jobs[jid].pop(k, None)
            slurm.jobs[jid].update(o)
            ids.append(jid)
        sh = make_shell(slurm, Path(d), QUOTA)
        sh.step()
        sh.step()
        assert sorted(sh.core.records) == sorted(ids)  # none lost to an odd owner
        for jid in ids:
            assert (sh.core.records[jid].job.user, sh.core.records[jid].job.account) == \
                (lambda j: (j.user, j.account))(parse_job(slurm.jobs[jid]))
        assert sh.stats.refused == 0
        sh.close()


def test_a_job_past_its_owners_queued_limit_stays_held_with_the_reason(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=1, slots=1)
    a1, a2, a3 = (slurm.submit("LM@8", user_name="alice", user_id=1001) for _ in range(3))
    b1 = slurm.submit("LM@8", user_name="bob", user_id=1002)
    sh = make_shell(slurm, tmp_path, BASE.format(name="fifo-queued") + "[quota.default_user]\nqueued = 1\n")
    sh.step()
    assert slurm.schedule() == [a1]
    j = parse_job(slurm.jobs[a3])  # rejected at arrival: it never runs here, Slurm keeps it held
    assert j.held and "cannot run: user 'alice' has 1 jobs waiting; its quota is 1" in j.comment, j.comment
    assert sh.core.records[a3].job.state is JobState.FAILED
    assert sh.core.records[a2].job.state is JobState.QUEUED and sh.core.records[b1].job.state is JobState.QUEUED


def test_restart_under_a_new_quota_replays_and_requeues_what_is_now_over_it(tmp_path):
    slurm = FakeSlurm(nodes=1, gpus=2, slots=1)
    a, b = (slurm.submit("LM@8", user_name="alice", user_id=1001) for _ in range(2))
    sh = make_shell(slurm, tmp_path, BASE.format(name="p"))
    sh.step()
    assert slurm.schedule() == [a, b]
    sh.close()
    sh2 = make_shell(slurm, tmp_path, BASE.format(name="p") + "[quota.default_user]\ngpus = 1\n")  # same journal
    assert [x.kind for x in sh2.step()] == ["requeue"]
    assert [slurm.jobs[j]["job_state"] for j in (a, b)] == ["RUNNING", "PENDING"] and slurm.jobs[b]["priority"] == 0
