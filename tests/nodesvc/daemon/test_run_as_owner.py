"""A node daemon (root, cgroup v1 here) runs each job as its owner: real users made with useradd,
and the job's real process read back from /proc.  One daemon serves the module."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import pytest

from nodesvc.bus.procs import wait_until
from nodesvc.bus.rpc import CommandError, NodeClient
from tests.adversarial.conftest import module_mosquitto, wait_ping  # noqa: F401 (a module-scoped broker)
from tests.conftest import NodeProc
from tests.local_users import proc_ids

NODE = "owner-node"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starting jobs as other users needs root")


@pytest.fixture(scope="module")
def job_root():
    """The daemon's job directory root, under a directory every user may pass through (pytest's
    tmp_path is 0700, which no job user could enter)."""
    base = Path(tempfile.mkdtemp(prefix="dlshare-owner-", dir="/tmp"))
    os.chmod(base, 0o711)
    yield base / "jobs"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(module_mosquitto, tmp_path_factory, job_root):
    """(broker URL, the daemon): --allow-run, root jobs refused, LD_LIBRARY_PATH allowed by name."""
    tmp = tmp_path_factory.mktemp("owner")
    env = {"DLSHARE_NODE_JOB_DIR": str(job_root), "DLSHARE_NODE_JOB_ENV_ALLOW": '["*", "LD_LIBRARY_PATH"]',
           "DAEMON_ONLY_SECRET": "s3cret"}
    url = module_mosquitto.replace("mqtt://", "mqtt://daemon-user:daemon-pass@")  # mosquitto ignores it here
    node = NodeProc(url, NODE, tmp, ("--allow-run", "--metrics-listen", "127.0.0.1:-1"), 0.5, env)
    asyncio.run(wait_ping(module_mosquitto, NODE))
    yield module_mosquitto, node
    node.stop()


@pytest.fixture(scope="module")
def alice(local_users):
    return local_users.user(groups=[local_users.group(), local_users.group()])


@pytest.fixture(scope="module")
def bob(local_users):
    return local_users.user()


def _job() -> str:
    return f"own-{uuid.uuid4().hex[:8]}"


async def _run(url: str, job: str, user: str | None, argv: list[str], **kw) -> dict:
    async with NodeClient(url) as c:
        args = {"job": job, "argv": argv, **kw}
        if user is not None:
            args["user"] = user
        return await c.call(NODE, "run", timeout=15, **args)


async def _run_to_exit(url: str, job: str, user: str, argv: list[str]) -> dict:
    """Run a job and wait for its exit event; returns the run's result."""
    async with NodeClient(url) as c:
        res = await c.call(NODE, "run", job=job, user=user, argv=argv, timeout=15)
        await asyncio.wait_for(_exit_of(c, job), 15)
    return res


async def _refused(url: str, job: str, user: str | None, argv: list[str], **kw) -> str:
    with pytest.raises(CommandError) as err:
        await _run(url, job, user, argv, **kw)
    return str(err.value)


async def _stop(url: str, job: str) -> None:
    async with NodeClient(url) as c:
        await c.call(NODE, "stop", job=job, signal="SIGKILL", timeout=10)
        await c.call(NODE, "release", job=job, timeout=10)


async def test_a_job_runs_with_its_owners_uid_gid_and_groups(daemon, alice, job_root):
    """Promise: the job's process has the owner's uid and gid (real, effective, saved, fs), exactly
    the owner's groups, no_new_privs, sits in its cgroup, and works in its own directory, which
    is the owner's (0700) like its log."""
    url, _ = daemon
    job = _job()
    res = await _run(url, job, alice.name, ["/bin/sh", "-c", "pwd; echo started; exec sleep 30"], cpus=0.5,
                     memory_bytes=64 << 20)
    try:
        assert (res["user"], res["uid"], res["gid"]) == (alice.name, alice.uid, alice.gid)
        pid = res["pid"]
        wait_until(lambda: "started" in Path(res["log"]).read_text(), 10, "the job to start")
        ids = proc_ids(pid)
        assert ids["Uid"] == [alice.uid] * 4 and ids["Gid"] == [alice.gid] * 4, ids
        assert sorted(ids["Groups"]) == sorted(alice.groups) and ids["NoNewPrivs"] == [1], ids
        assert f"dlshare/{NODE}/{job}" in Path(f"/proc/{pid}/cgroup").read_text()
        workdir = job_root / job
        assert Path(res["log"]) == workdir / "job.log"
        for p, mode in ((workdir, 0o700), (workdir / "job.log", 0o600)):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (alice.uid, alice.gid, mode), p
        assert Path(res["log"]).read_text().splitlines()[0] == str(workdir)
        assert stat.S_IMODE(os.stat(job_root).st_mode) == 0o711 and os.stat(job_root).st_uid == 0
    finally:
        await _stop(url, job)


async def test_the_job_environment_is_built_for_it(daemon, alice):
    """Promise: a job sees its owner's HOME/USER/LOGNAME, the launcher's allowed variables and the
    daemon's DLSHARE_* ones, and nothing else of the daemon's environment: not its variables, not
    its broker credentials."""
    url, _ = daemon
    job = _job()
    res = await _run(url, job, alice.name, ["/usr/bin/env"], env={"MY_VAR": "1", "LD_LIBRARY_PATH": "/opt/lib"})
    wait_until(lambda: "DLSHARE_JOB=" in Path(res["log"]).read_text(), 10, "the job's environment")
    env = dict(line.split("=", 1) for line in Path(res["log"]).read_text().splitlines() if "=" in line)
    assert env["USER"] == env["LOGNAME"] == alice.name and env["HOME"] == "/nonexistent"
    assert env["MY_VAR"] == "1" and env["LD_LIBRARY_PATH"] == "/opt/lib" and env["DLSHARE_JOB"] == job
    assert "DAEMON_ONLY_SECRET" not in env and "DLSHARE_NODE_JOB_DIR" not in env and env["DLSHARE_NODE_ID"] == NODE
    assert "daemon-pass" not in env["DLSHARE_BROKER"] and env["DLSHARE_BROKER"].startswith("mqtt://127.0.0.1:")
    assert env["PATH"]


async def test_root_system_and_unknown_users_are_refused(daemon):
    """Promise: with node.allow_root_jobs off, a run as root, or with no user (the daemon's own,
    root), is refused; so are system accounts (uid below node.min_job_uid) and users this node
    does not have.  Nothing starts."""
    url, _ = daemon
    for user, why in (("root", "allow_root_jobs"), (None, "allow_root_jobs"), ("daemon", "min_job_uid"),
                      ("nosuchuser27", "no user")):
        job = _job()
        msg = await _refused(url, job, user, ["/bin/sh", "-c", "id > /tmp/dlshare-owner-pwned"])
        assert why in msg, msg
    assert not os.path.exists("/tmp/dlshare-owner-pwned")


async def test_loader_variables_are_refused(daemon, alice):
    """Promise: LD_PRELOAD (deny list) is refused with its name and the setting that allows it,
    before anything is applied; LD_LIBRARY_PATH, named in this node's allow list, passes."""
    url, _ = daemon
    msg = await _refused(url, _job(), alice.name, ["/bin/true"], env={"LD_PRELOAD": "/tmp/evil.so", "GCONV_PATH": "/x"})
    assert "LD_PRELOAD" in msg and "GCONV_PATH" in msg and "node.job_env_allow" in msg


async def test_a_job_id_belongs_to_its_first_owner_on_the_node(daemon, alice, bob):
    """Promise: another user cannot take over a job directory (its checkpoints, its log) by running
    a job of the same id."""
    url, _ = daemon
    job = _job()
    await _run_to_exit(url, job, alice.name, ["/bin/true"])
    msg = await _refused(url, job, bob.name, ["/bin/true"])
    assert "belongs to uid" in msg and str(alice.uid) in msg


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
async def test_a_planted_log_is_refused_without_writing_through_it(daemon, alice, job_root, plant):
    """Promise: the owner controls their job directory, so a job.log they planted there as a
    symbolic link, a hard link to another file or a FIFO is refused: the daemon (root) never
    writes through it, and never blocks on it."""
    url, _ = daemon
    job = _job()
    await _run_to_exit(url, job, alice.name, ["/bin/true"])
    victim = job_root.parent / f"victim-{plant}"
    victim.write_text("precious\n")
    log = job_root / job / "job.log"
    log.unlink()
    if plant == "symlink":
        log.symlink_to(victim)
    elif plant == "hardlink":
        os.chown(victim, alice.uid, alice.gid)  # even a file of the user's: two links are refused
        os.link(victim, log)
    else:
        os.mkfifo(log)
    msg = await _refused(url, job, alice.name, ["/bin/sh", "-c", "echo overwritten"])
    assert "job.log" in msg, msg
    assert victim.read_text() == "precious\n"


async def test_a_working_directory_the_owner_cannot_enter_fails_the_job(daemon, alice):
    """Promise: the job enters its working directory as its owner, so one the owner may not enter
    (root's home) ends the job with 126 and the reason in its log, instead of running it there."""
    url, _ = daemon
    job = _job()
    async with NodeClient(url) as c:
        res = await c.call(NODE, "run", job=job, user=alice.name, argv=["/bin/sh", "-c", "ls"], cwd="/root",
                           timeout=15)
        ev = await asyncio.wait_for(_exit_of(c, job), 15)
    assert ev["exit_code"] == 126
    assert "cannot enter its working directory /root" in Path(res["log"]).read_text()


async def _exit_of(c: NodeClient, job: str) -> dict:
    while True:
        ev = await c.events.get()
        if ev.get("event") == "job_exit" and ev.get("job") == job:
            return ev


def test_a_daemon_that_is_not_root_starts_jobs_only_as_itself(monkeypatch, alice):
    """Promise: a daemon that is not root starts jobs only as itself, and says why otherwise."""
    from nodesvc.daemon import runas

    monkeypatch.setattr(runas.os, "geteuid", lambda: alice.uid)
    with pytest.raises(runas.RunAsError, match="starts jobs only as itself"):
        runas.resolve("root", True, 0)
    assert runas.resolve(None, False, 1000).uid == alice.uid
    with pytest.raises(runas.RunAsError, match="allow_root_jobs"):
        runas.resolve("root", False, 1000)


def test_an_exited_jobs_record_is_forgotten_after_five_minutes_on_the_daemons_clock(tmp_path):
    """The job table's time is injected: five minutes pass in a millisecond."""
    from nodesvc.daemon.jobs import JobTable
    from nodesvc.daemon.runas import resolve
    from nodesvc.bus.procs import wait_until
    from tests.fake_clock import ManualClock

    clock = ManualClock(5000.0)
    table = JobTable(str(tmp_path), clock=clock)
    creds = resolve(None, allow_root=True, min_uid=1000)
    table.start("j1", ["/bin/true"], {"PATH": "/usr/bin:/bin", **creds.base_env()}, None, [], creds)
    ended: list = []
    wait_until(lambda: ended.extend(table.reap()) or ended, timeout=60)
    assert [jp.exit_code for jp in ended] == [0] and ended[0].exited_at == 5000.0
    clock.advance(300.0)
    table.forget_exited()
    assert "j1" in table.jobs  # exactly five minutes: kept
    clock.advance(0.1)
    table.forget_exited()
    assert "j1" not in table.jobs
