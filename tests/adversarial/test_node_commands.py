"""Attacks through a node's command topic: anyone who may publish to ``dlshare/v1/node/<id>/cmd``.

One real daemon (cgroup enforcement on this machine's cgroup v1, lending on) serves every attack
of the module; an attack that kills or confines it fails its own test and the ones after it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from nodesvc import cgroups
from nodesvc.bus import messages
from nodesvc.bus.rpc import CommandError, NodeClient
from tests.adversarial.conftest import wait_ping
from tests.conftest import NodeProc

NODE = "adv-node"
V1 = cgroups.detect("/sys/fs/cgroup") == 1 and os.geteuid() == 0
pytestmark = pytest.mark.skipif(not V1, reason="needs root and cgroup v1 (present on the dev and CI machines)")


@pytest.fixture(scope="module")
def daemon(module_mosquitto, tmp_path_factory):
    """The node daemon under attack: (broker URL, NodeProc)."""
    tmp = tmp_path_factory.mktemp("node")
    env = {"DLSHARE_DONOR_SLAB_BYTES": str(1 << 20), "DLSHARE_DONOR_HEADROOM_BYTES": str(64 << 20),
           "DLSHARE_DONOR_MAX_SLABS": "8"}
    node = NodeProc(module_mosquitto, NODE, tmp, ("--lend", "--metrics-listen", "127.0.0.1:-1"), 0.5, env)
    import asyncio

    asyncio.run(wait_ping(module_mosquitto, NODE))
    yield module_mosquitto, node
    node.stop()
    for c, base in _bases(node.pid).items():
        for g in sorted(base.glob("*"), reverse=True):
            if g.is_dir():
                try:
                    g.rmdir()
                except OSError:
                    pass


def _cgroup_of(pid: int) -> dict[str, str]:
    """pid's cgroup path per v1 controller (cpu, cpuset, memory)."""
    own = cgroups.own_cgroup(1, f"/proc/{pid}/cgroup")
    return {c: own.get(c, "/") for c in ("cpu", "cpuset", "memory")}


def _bases(daemon_pid: int) -> dict[str, Path]:
    """Where the daemon makes its job groups, per controller."""
    return {c: Path("/sys/fs/cgroup", c, p.lstrip("/"), "dlshare", NODE)
            for c, p in _cgroup_of(daemon_pid).items() if Path("/sys/fs/cgroup", c).is_dir()}


def _sleeper(threads: int = 0) -> subprocess.Popen:
    code = "import threading,time\n" + "".join(
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n" for _ in range(threads)
    ) + "print('up', flush=True)\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def _tids(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


async def _refused(c: NodeClient, op: str, **args) -> str:
    with pytest.raises(CommandError) as err:
        await c.call(NODE, op, timeout=10, **args)
    return str(err.value)


async def test_a_daemon_thread_id_cannot_put_the_daemon_under_an_allocation(daemon):
    """Promise: allocate refuses every thread of init, the daemon and its ancestors (a thread id
    written to cgroup.procs moves its whole process), so no command can confine or kill the
    daemon.  (Issue 16, failure 1: a daemon thread id was accepted, then stop SIGKILL killed it.)"""
    url, node = daemon
    before = _cgroup_of(node.pid)
    threads = [t for t in _tids(node.pid) if t != node.pid]
    assert threads, "the daemon has no threads besides its main one"
    async with NodeClient(url) as c:
        for tid in threads:
            msg = await _refused(c, "allocate", job=f"evil-{tid}", pids=[tid], memory_bytes=1 << 20)
            assert "cannot be allocated" in msg and str(node.pid) in msg, msg
        for tid in threads:
            with pytest.raises(CommandError):
                await c.call(NODE, "stop", job=f"evil-{tid}", signal="SIGKILL", timeout=10)
        await c.call(NODE, "ping", timeout=10)
    assert node.poll() is None
    assert _cgroup_of(node.pid) == before


async def test_a_thread_of_the_daemons_ancestor_is_refused(daemon):
    """Promise: a thread of one of the daemon's ancestors (here this test process, which started
    it) is refused like the ancestor itself."""
    url, _ = daemon
    started = threading.Event()
    done = threading.Event()

    def park() -> None:
        started.set()
        done.wait(30)

    t = threading.Thread(target=park, daemon=True)
    t.start()
    started.wait(5)
    try:
        assert t.native_id != os.getpid()
        async with NodeClient(url) as c:
            msg = await _refused(c, "allocate", job="evil-ancestor", pids=[t.native_id], cpus=4096)
        assert "cannot be allocated" in msg and str(os.getpid()) in msg, msg
        assert _cgroup_of(os.getpid())["cpu"].find("evil-ancestor") < 0
    finally:
        done.set()
        t.join(5)


async def test_a_thread_id_of_a_job_process_adopts_its_whole_process(daemon):
    """Promise: a thread id in allocate is resolved to its process (thread group), which is what the
    kernel moves and what the daemon then tracks and signals."""
    url, node = daemon
    p = _sleeper(threads=2)
    job = "tgid-job"
    try:
        tid = [t for t in _tids(p.pid) if t != p.pid][0]
        async with NodeClient(url) as c:
            r = await c.call(NODE, "allocate", job=job, pids=[tid], cpus=1.0, timeout=10)
            assert r["pids"] == [p.pid]
            assert str(p.pid) in (_bases(node.pid)["cpu"] / job / "cgroup.procs").read_text().split()
            r = await c.call(NODE, "stop", job=job, signal="SIGKILL", timeout=10)
            assert p.pid in r["signalled"]
            p.wait(10)
            await c.call(NODE, "release", job=job, timeout=10)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("job", ["job\n", "a" * 127 + "\n", "job\r", "../escape", "a/b", "", "a" * 129, "j\u00e9b",
                                 ".hidden", "job\x00x"])
async def test_a_job_id_outside_the_id_rule_is_refused_before_any_cgroup_is_touched(daemon, job):
    """Promise: a job id that is not 1-128 of [A-Za-z0-9_.-] starting with a letter or digit is
    refused with the rule, and nothing is created.  (Issue 16, failure 7: "job\\n" passed the
    check and failed in the cgroup filesystem.)"""
    url, node = daemon
    groups = {c: sorted(b.iterdir()) if b.is_dir() else [] for c, b in _bases(node.pid).items()}
    async with NodeClient(url) as c:
        msg = await _refused(c, "allocate", job=job, cpus=0.5)
    assert "invalid job id" in msg, msg
    assert {c: sorted(b.iterdir()) if b.is_dir() else [] for c, b in _bases(node.pid).items()} == groups


async def test_a_failed_allocate_leaves_no_half_made_cgroup(daemon):
    """Promise: an allocate that fails part-way (here a cpuset naming a CPU the node lacks) leaves
    no group behind and puts its processes back where they were.  (Issue 16, failure 7.)"""
    url, node = daemon
    p = _sleeper()
    job = "half-made"
    try:
        before = _cgroup_of(p.pid)
        async with NodeClient(url) as c:
            msg = await _refused(c, "allocate", job=job, pids=[p.pid], cpus=0.5, cpuset="4000",
                                 memory_bytes=256 << 20)
        assert "cpuset" in msg, msg
        for ctrl, base in _bases(node.pid).items():
            assert not (base / job).exists(), f"{ctrl} group of a failed allocate was left behind"
        assert _cgroup_of(p.pid) == before
    finally:
        p.kill()
        p.wait()


async def test_a_failed_reallocate_leaves_the_existing_allocation_alone(daemon):
    """Promise: a failed allocate of a job that already has an allocation keeps that allocation
    (its group and processes), instead of tearing it down."""
    url, node = daemon
    p = _sleeper()
    job = "kept"
    try:
        async with NodeClient(url) as c:
            await c.call(NODE, "allocate", job=job, pids=[p.pid], cpus=0.5, timeout=10)
            await _refused(c, "allocate", job=job, cpus=0.5, cpuset="4000")
            cpu = _bases(node.pid)["cpu"] / job
            assert str(p.pid) in (cpu / "cgroup.procs").read_text().split()
            await c.call(NODE, "release", job=job, timeout=10)
    finally:
        p.kill()
        p.wait()


async def test_release_puts_processes_back_in_their_own_cgroup(daemon):
    """Promise: release moves a job's processes back to the cgroups they were in before allocate,
    not to the daemon's dlshare/ group.  (Issue 16, failure 7.)"""
    url, node = daemon
    origin = Path("/sys/fs/cgroup/cpu", f"adv-origin-{uuid.uuid4().hex[:8]}")
    origin.mkdir()
    p = _sleeper()
    try:
        (origin / "cgroup.procs").write_text(str(p.pid))
        before = _cgroup_of(p.pid)
        assert before["cpu"] == "/" + origin.name
        async with NodeClient(url) as c:
            await c.call(NODE, "allocate", job="homebound", pids=[p.pid], cpus=0.5, memory_bytes=512 << 20,
                         timeout=10)
            assert _cgroup_of(p.pid) != before
            await c.call(NODE, "release", job="homebound", timeout=10)
        assert _cgroup_of(p.pid) == before
    finally:
        p.kill()
        p.wait()
        time.sleep(0.05)
        origin.rmdir()


@pytest.mark.parametrize("op,args,what", [
    ("reclaim", '{"pause_s": 1e308}', "pause_s"),
    ("reclaim", '{"pause_s": 1e400}', "pause_s"),  # JSON 1e400 is an infinite float in Python
    ("reclaim", '{"bytes": 1000000000000000000000000000000}', "bytes"),
    ("map", '{"consumer": "c1", "lease_s": 1e400}', "lease_s"),
    ("map", '{"consumer": "c1", "lease_s": 1e308}', "lease_s"),
    ("map", '{"consumer": "c1", "count": 1e3}', "count"),
    ("renew", '{"consumer": "c1", "lease_s": 1e308}', "lease_s"),
    ("unmap", '{"slab": 100000000000000000000, "token": "00"}', "slab"),
    ("allocate", '{"job": "j", "cpus": 1e400}', "cpus"),
    ("allocate", '{"job": "j", "memory_bytes": 1e20}', "memory_bytes"),
    ("stop", '{"job": "j", "signal": 1000000000000000000000000000000}', "signal"),
])
async def test_numbers_out_of_their_finite_bounds_are_refused_and_lending_goes_on(daemon, op, args, what):
    """Promise: every number a node or donor command takes has finite bounds; one outside them is
    refused naming the argument, and nothing changes: here the donor still lends afterwards.
    (Issue 16, failure 7: reclaim pause_s 1e308 stopped lending until a restart.)"""
    url, _ = daemon
    cid = f"bounds-{uuid.uuid4().hex[:8]}"
    payload = f'{{"schema":1,"id":"{cid}","op":"{op}","args":{args}}}'.encode()
    async with NodeClient(url) as c:
        reply = await c.send_raw(NODE, payload, cmd_id=cid, timeout=10)
        assert reply["ok"] is False and what in reply["error"], reply
        r = await c.call(NODE, "map", consumer="bounds-probe", timeout=10)
        await c.call(NODE, "unmap", slab=r["slab"], token=r["token"], timeout=10)


async def test_malformed_payloads_get_error_replies_and_the_daemon_stays_up(daemon):
    """Promise: no payload a publisher sends ends the daemon; each gets an error reply (when it has
    an id to answer to) and the daemon keeps serving."""
    url, node = daemon
    bad = [
        b"\xff\xfe not utf-8",
        b'{"schema":1,"id":"n1","op":"allocate","args":' + b"[" * 50000 + b"]" * 50000 + b"}",
        b'{"schema":1,"id":"n2","op":"allocate","args":{"job":"x","cpus":NaN}}',
        b'{"schema":1,"id":"n3","op":"allocate","args":{"job":"x","pids":[1e400]}}',
        b'{"schema":1,"id":"n4","op":"allocate","args":{"job":"x","pids":"1"}}',
        b'{"schema":1,"id":"n5","op":"map","args":{"consumer":"c","count":true}}',
        b'{"schema":1,"id":"n6","op":"unmap","args":{"slabs":[{"slab":1e400,"token":"00"}]}}',
        messages.command("run", "n7", job="x", argv=["/bin/true"]),  # run is off on this node
        b'{"schema":1,"id":"n8","op":"' + b"x" * 70 + b'"}',
        b'{"schema":1,"id":"n9","op":"allocate","args":{"job":"x","pids":[' + b"2," * 5000 + b'2]}}',
        b'{"schema":1,"id":"n10","op":"unmap","args":{"slab":' + b"9" * 5000 + b',"token":"00"}}',
        b'{"schema":1,"id":"n11","op":"allocate","args":{"job":"x"',  # cut short
    ]
    async with NodeClient(url) as c:
        for i, payload in enumerate(bad):
            cid = f"n{i}" if i else None
            if cid is None:
                await c._publish(messages.node_topic(NODE, "cmd"), payload, 1)
                continue
            reply = await c.send_raw(NODE, payload, cmd_id=cid, timeout=10)
            assert reply["ok"] is False and reply["error"], reply
        big = b'{"schema":1,"id":"big","op":"ping","args":{"x":"' + b"a" * (1 << 20) + b'"}}'
        await c._publish(messages.node_topic(NODE, "cmd"), big, 1)
        await c.call(NODE, "ping", timeout=10)
    assert node.poll() is None
    assert psutil.Process(node.pid).status() != psutil.STATUS_ZOMBIE
