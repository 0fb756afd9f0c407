"""Many users on one live stack: ``dlshare up`` (embedded broker with credentials, a node daemon
running as root, the scheduler), two real local users (useradd) with their own tokens, and their
jobs' real processes read back from /proc.  Then the attacks: one user on another's jobs, a job
escaping its user or its environment, a revoked token, the broker without credentials, a job
using the broker credential it was given to command a node, and one user flooding the queue.

One stack serves the module (about 10 s to start); the attacks leave it running."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import aiomqtt
import httpx
import pytest

from nodesvc.bus import messages
from nodesvc.bus.mqtt import parse_broker_url
from nodesvc.bus.procs import free_port, stop_proc, wait_until
from tests.adversarial.conftest import PY, ROOT
from tests.local_users import pids_of, proc_ids

ADMIN = "admin-token-" + uuid.uuid4().hex
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="real users and jobs run as them need root")


class Stack:
    def __init__(self, proc: subprocess.Popen, state: Path, url: str) -> None:
        self.proc, self.state, self.url = proc, state, url
        self.tokens: dict[str, str] = {}

    def api(self, who: str) -> httpx.Client:
        tok = ADMIN if who == "admin" else self.tokens[who]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {tok}"}, timeout=15)

    def operator(self) -> str:
        return (self.state / "operator.env").read_text().strip().partition("=")[2]


@pytest.fixture(scope="module")
def stack(local_users):
    """``dlshare up --nodes 1`` with a 3-jobs-waiting limit per user; users alice and bob, each with
    a token made by ``dlshare token create``."""
    base = Path(tempfile.mkdtemp(prefix="dlshare-users-", dir="/tmp"))
    os.chmod(base, 0o711)  # the users' jobs pass through it to their own directories
    sport = free_port()
    env = {**os.environ, "DLSHARE_SCHED_TOKEN": ADMIN, "DLSHARE_SCHED_PREDICTORS": "default",
           "DLSHARE_SCHED_MAX_WAITING_PER_USER": "3", "DLSHARE_SCHED_TICK_S": "0.5",
           "DLSHARE_UP_SCHED_LISTEN": f"127.0.0.1:{sport}", "DLSHARE_UP_AGG_LISTEN": f"127.0.0.1:{free_port()}"}
    log = open(base / "up.out", "ab")
    proc = subprocess.Popen([PY, "-m", "nodesvc.cli", "up", "--nodes", "1", "--fake-gpus", "1", "--netns", "off",
                             "--broker-listen", f"127.0.0.1:{free_port()}", "--state-dir", str(base / "state")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    st = Stack(proc, base / "state", f"http://127.0.0.1:{sport}")
    try:
        wait_until(lambda: b"press Ctrl-C" in (base / "up.out").read_bytes() or proc.poll() is not None, 90,
                   "dlshare up")
        assert proc.poll() is None, (base / "up.out").read_text()
        users = {"alice": local_users.user(groups=[local_users.group()]), "bob": local_users.user()}
        for who, u in users.items():
            out = subprocess.run([PY, "-m", "nodesvc.cli", "token", "--url", st.url, "--token", ADMIN, "create", u.name,
                                  "--account", "lab"], capture_output=True, text=True, cwd=ROOT, timeout=30)
            assert out.returncode == 0, out.stderr
            st.tokens[who] = out.stdout.strip()
        st.users = users
        yield st
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            stop_proc(proc)
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def _submit(st: Stack, who: str, job: str, argv: list[str], **spec) -> httpx.Response:
    with st.api(who) as c:
        return c.post("/v1/jobs", json={"id": job, "gpus": 0, "cpus": 0.1, "memory_bytes": 64 << 20,
                                        "command": argv, **spec})


def _job_process(uid: int, job: str) -> int | None:
    """The pid of ``job``'s process among ``uid``'s (its environment names the job)."""
    for pid in pids_of(uid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DLSHARE_JOB={job}".encode() in env:
            return pid
    return None


def _state(st: Stack, who: str, job: str) -> str:
    with st.api(who) as c:
        return c.get(f"/v1/jobs/{job}").json()["state"]


def test_two_users_jobs_run_as_their_owners_and_see_only_their_own(stack):
    """Promise (issue 27's "done when"): two users, each with a token, submit jobs through the API
    on a live stack; each job's process runs under its owner's uid, gid and groups (read from
    /proc), each user lists only their own jobs, and the other's job is refused (404) to read,
    cancel, follow or take over by resubmitting its id."""
    st = stack
    tag = uuid.uuid4().hex[:6]
    jobs = {who: f"{who}-{tag}" for who in ("alice", "bob")}
    for who, job in jobs.items():
        r = _submit(st, who, job, ["/bin/sh", "-c", "echo $(id -u) > uid.txt; exec sleep 60"])
        assert r.status_code == 201 and r.json()["user"] == st.users[who].name, r.text
    for who, job in jobs.items():
        u = st.users[who]
        wait_until(lambda: _job_process(u.uid, job) is not None, 30, f"{who}'s job to run")
        ids = proc_ids(_job_process(u.uid, job))
        assert ids["Uid"] == [u.uid] * 4 and ids["Gid"] == [u.gid] * 4 and sorted(ids["Groups"]) == list(u.groups)
        assert ids["NoNewPrivs"] == [1]
        assert _state(st, who, job) == "running"
    with st.api("alice") as a:
        mine = [j["id"] for j in a.get("/v1/jobs").json()["jobs"]]
        assert jobs["alice"] in mine and jobs["bob"] not in mine
        for r in (a.get(f"/v1/jobs/{jobs['bob']}"), a.get(f"/v1/jobs/{jobs['bob']}/events"),
                  a.delete(f"/v1/jobs/{jobs['bob']}")):
            assert r.status_code == 404, r.text
        r = a.post("/v1/jobs", json={"id": jobs["bob"], "cpus": 0.1, "command": ["/bin/true"]})
        assert r.status_code == 409
    assert _state(st, "bob", jobs["bob"]) == "running"
    with st.api("admin") as adm:
        everyone = {j["id"]: j["user"] for j in adm.get("/v1/jobs").json()["jobs"]}
        assert everyone[jobs["alice"]] == st.users["alice"].name and everyone[jobs["bob"]] == st.users["bob"].name
    for who, job in jobs.items():
        with st.api(who) as c:
            assert c.delete(f"/v1/jobs/{job}").json()["state"] == "cancelled"


def test_a_user_cannot_run_as_root_or_anyone_else_nor_escape_the_environment(stack):
    """Promise: a user's spec naming another owner (root, the other user) is refused (403), so is a
    loader variable (LD_PRELOAD), and nothing of either is queued."""
    st = stack
    for spec, what in (({"user": "root"}, "only as"), ({"user": st.users["bob"].name}, "only as"),
                       ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD")):
        r = _submit(st, "alice", f"evil-{uuid.uuid4().hex[:6]}", ["/bin/sh", "-c", "id"], **spec)
        assert r.status_code == 403 and what in r.json()["detail"], r.text
    with st.api("alice") as a:
        assert not [j for j in a.get("/v1/jobs").json()["jobs"] if j["id"].startswith("evil-")]


def test_a_revoked_token_is_refused_at_once(stack):
    """Promise: a token revoked with `dlshare token revoke` gets 401 on its very next request."""
    st = stack
    out = subprocess.run([PY, "-m", "nodesvc.cli", "token", "--url", st.url, "--token", ADMIN, "--json", "create",
                          st.users["alice"].name], capture_output=True, text=True, cwd=ROOT, timeout=30)
    tok = json.loads(out.stdout)
    h = {"Authorization": f"Bearer {tok['token']}"}
    assert httpx.get(f"{st.url}/v1/jobs", headers=h).status_code == 200
    rv = subprocess.run([PY, "-m", "nodesvc.cli", "token", "--url", st.url, "--token", ADMIN, "revoke", tok["id"]],
                        capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert rv.returncode == 0 and "revoked" in rv.stdout
    r = httpx.get(f"{st.url}/v1/jobs", headers=h)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


async def test_the_broker_refuses_anonymous_clients_and_their_node_commands(stack):
    """Promise: the embedded broker of `dlshare up` refuses a client without credentials, so the
    issue's `run` of `id > out.txt` on node-1's command topic never reaches the node; a wrong
    password is refused too."""
    addr = parse_broker_url(stack.operator())
    for user, pw in ((None, None), ("dlshare-operator", "wrong"), ("node-1", "")):
        with pytest.raises(aiomqtt.MqttError):
            async with aiomqtt.Client(addr.host, addr.port, username=user, password=pw, timeout=5) as c:
                await c.publish("dlshare/v1/node/node-1/cmd", messages.command(
                    "run", "pwn", job="pwn", argv=["/bin/sh", "-c", "id > /tmp/dlshare-pwned"]), qos=1)


async def test_a_jobs_broker_credential_borrows_memory_but_commands_nothing(stack):
    """Promise: a job gets the memory consumers' broker credential (to borrow lent memory); with it,
    a `run` as root on the node's command topic is dropped by the broker, and on the node's memory
    topic refused by the node; a memory op there is answered."""
    st = stack
    job = f"peek-{uuid.uuid4().hex[:6]}"
    assert _submit(st, "alice", job, ["/bin/sh", "-c", "env; exec sleep 30"]).status_code == 201
    log = st.state / "node-1" / "jobs" / job / "job.log"
    wait_until(lambda: log.exists() and "DLSHARE_BROKER=" in log.read_text(), 30, "the job's environment")
    url = [line.partition("=")[2] for line in log.read_text().splitlines() if line.startswith("DLSHARE_BROKER=")][0]
    addr = parse_broker_url(url)
    assert addr.username == "dlshare-memory"
    evil = "/tmp/dlshare-pwned-" + uuid.uuid4().hex[:6]
    async with aiomqtt.Client(addr.host, addr.port, username=addr.username, password=addr.password, timeout=5) as c:
        await c.subscribe("dlshare/v1/node/node-1/reply", qos=1)
        run = dict(job="pwn", argv=["/bin/sh", "-c", f"id > {evil}"], user="root")
        await c.publish("dlshare/v1/node/node-1/cmd", messages.command("run", "pwn-cmd", **run), qos=1)
        await c.publish("dlshare/v1/node/node-1/mem", messages.command("run", "pwn-mem", **run), qos=1)
        await c.publish("dlshare/v1/node/node-1/mem", messages.command("donor_status", "ok-mem"), qos=1)
        replies = {}

        async def collect() -> None:
            async for m in c.messages:
                body = json.loads(m.payload)
                replies[body.get("id")] = body
                if {"pwn-mem", "ok-mem"} <= set(replies):
                    return

        await asyncio.wait_for(collect(), 15)
    assert not replies["pwn-mem"]["ok"] and "not a memory consumer's" in replies["pwn-mem"]["error"]
    assert "pwn-cmd" not in replies  # the broker never delivered it
    time.sleep(0.5)
    assert not os.path.exists(evil)
    with st.api("alice") as a:
        a.delete(f"/v1/jobs/{job}")


def test_a_flooding_user_is_held_to_the_waiting_limit_and_others_still_run(stack):
    """Promise: one user flooding the queue gets 429 (with the reason) once they have
    sched.max_waiting_per_user (3) jobs waiting, while another user's job is still accepted and
    runs.  (Fair share between users, which orders the queue, is the scheduler core's.)"""
    st = stack
    tag = uuid.uuid4().hex[:6]
    codes = []
    for i in range(8):  # GPU jobs on a one-GPU node: one runs, the rest wait
        r = _submit(st, "alice", f"flood-{tag}-{i}", ["/bin/sleep", "60"], gpus=1, cpus=0.2)
        codes.append(r.status_code)
        if r.status_code == 429:
            assert "max_waiting_per_user" in r.json()["detail"]
    assert codes[-1] == 429 and codes.count(201) >= 3, codes  # some run (GPUs may be shared), 3 wait
    with st.api("alice") as a:
        waiting = a.get("/v1/jobs", params=[("state", "queued"), ("state", "preempted")]).json()["jobs"]
        assert len([j for j in waiting if j["id"].startswith(f"flood-{tag}")]) <= 3
    try:
        ok = _submit(st, "bob", f"other-{tag}", ["/bin/true"])
        assert ok.status_code == 201
        wait_until(lambda: _state(st, "bob", f"other-{tag}") == "done", 30, "bob's job to run")
    finally:
        with st.api("alice") as a:
            for i in range(8):
                a.delete(f"/v1/jobs/flood-{tag}-{i}")


def test_an_expired_token_is_refused(tmp_path):
    """Promise: a token past its expiry gets 401 saying so (the service's clock, in-process)."""
    from fastapi.testclient import TestClient

    from scheduler.service.api import create_app
    from scheduler.service.live import SchedulerService
    from scheduler.service.store import JobStore
    from scheduler.service.tokens import TokenBook

    now = [1_000_000.0]
    store = JobStore(tmp_path / "s.db", synchronous="NORMAL")
    try:
        book = TokenBook(store, ADMIN, "ops", clock=lambda: now[0])
        _, tok = book.create("mallory", ttl_s=3600)
        with TestClient(create_app(SchedulerService(store), ADMIN, tokens=book)) as c:
            h = {"Authorization": f"Bearer {tok}"}
            assert c.get("/v1/jobs", headers=h).status_code == 200
            now[0] += 3600
            r = c.get("/v1/jobs", headers=h)
            assert r.status_code == 401 and "expired" in r.json()["detail"]
            assert c.post("/v1/jobs", headers=h, json={"cpus": 1, "command": ["x"]}).status_code == 401
    finally:
        store.close()
