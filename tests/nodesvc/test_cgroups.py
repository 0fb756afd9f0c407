"""cgroup enforcement: real v1 on this machine, v2 on a fake tree laid out as the kernel's."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from nodesvc import cgroups
from nodesvc.bus.procs import wait_until
from nodesvc.cgroups import CgroupLimits, CgroupV1, CgroupV2

V1 = cgroups.detect("/sys/fs/cgroup") == 1 and os.geteuid() == 0
needs_v1 = pytest.mark.skipif(not V1, reason="needs root and a cgroup v1 hierarchy (present on the dev and CI machines)")

BUSY = "import time\nt=time.time()\nwhile time.time()-t<30: pass\n"
HOG = "b=bytearray(256<<20)\nfor i in range(0,len(b),4096): b[i]=1\nimport time; time.sleep(30)\n"


def test_parse_cpuset():
    assert cgroups.parse_cpuset("0-3,8") == [0, 1, 2, 3, 8]
    assert cgroups.parse_cpuset(" 1 , 1 ") == [1]
    for bad in ("3-1", "x", "-1", "1-"):
        with pytest.raises(ValueError):
            cgroups.parse_cpuset(bad)


@pytest.fixture
def v1():
    drv = CgroupV1("/sys/fs/cgroup")  # the default layout: <own cgroup per controller>/dlshare
    assert all(b.name == "dlshare" for b in drv.bases.values())
    name = f"dlshare-test-{uuid.uuid4().hex[:8]}"  # a private sibling, so a running daemon is not disturbed
    drv.bases = {c: b.parent / name for c, b in drv.bases.items()}
    yield drv
    for c, b in drv.bases.items():
        for g in sorted(b.glob("*"), reverse=True):
            if g.is_dir():
                for pid in (g / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
                try:
                    g.rmdir()
                except OSError:
                    pass
        try:
            b.rmdir()
        except OSError:
            pass


def _cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


@needs_v1
def test_v1_cpu_quota_holds_busy_loop_to_half_a_core(v1):
    p = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        v1.apply(CgroupLimits("cpu-half", cpus=0.5), [p.pid])
        assert p.pid in v1.pids("cpu-half")
        assert (v1.path("cpu-half", "cpu") / "cpu.cfs_quota_us").read_text().strip() == "50000"
        stat = v1.path("cpu-half", "cpu") / "cpu.stat"

        def throttled() -> int:
            return int(dict(line.split() for line in stat.read_text().splitlines())["nr_throttled"])

        # Load-proof: the loop reaches its quota in some 100 ms period however busy the machine is (an
        # event, waited for), and the quota is a ceiling that load can only push it further below.
        thr0 = throttled()
        wait_until(lambda: throttled() > thr0, 30, "the kernel to throttle the busy loop at its quota")
        c0, t0 = _cpu_seconds(p.pid), time.monotonic()
        time.sleep(2.0)  # a measurement window: what is asserted of it is a ceiling, not an amount done
        share = (_cpu_seconds(p.pid) - c0) / (time.monotonic() - t0)
        assert share < 0.62, share  # an unthrottled loop on a free core would take ~1.0
    finally:
        p.kill()
        p.wait()
    v1.release("cpu-half")
    assert not v1.path("cpu-half", "cpu").exists()


@needs_v1
def test_v1_memory_limit_stops_child_with_oom_kill(v1):
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(1)\n" + HOG], stdin=subprocess.PIPE)
    v1.apply(CgroupLimits("mem-64m", memory_bytes=64 << 20), [p.pid])
    assert (v1.path("mem-64m", "memory") / "memory.limit_in_bytes").read_text().strip() == str(64 << 20)
    p.stdin.write(b"x")
    p.stdin.flush()
    rc = p.wait(timeout=30)
    assert rc == -signal.SIGKILL  # the kernel's OOM killer, as documented for memory.limit_in_bytes
    assert v1.oom_kills("mem-64m") >= 1
    v1.release("mem-64m")


@needs_v1
def test_v1_cpuset_and_release_moves_processes_out(v1):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        v1.apply(CgroupLimits("pinned", cpuset="0"), [p.pid])
        if "cpuset" in v1.bases:
            assert (v1.path("pinned", "cpuset") / "cpuset.cpus").read_text().strip() == "0"
            time.sleep(0.1)
            assert psutil.Process(p.pid).cpu_affinity() == [0]
        v1.release("pinned")
        assert p.poll() is None  # release frees the limits, it does not kill
        assert not v1.path("pinned", "cpu").exists()
    finally:
        p.kill()
        p.wait()


def _fake_v2(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    svc = root / "system.slice" / "dlshare-node.service"
    svc.mkdir(parents=True)
    (svc / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    (svc / "cgroup.subtree_control").write_text("")
    (svc / "cgroup.procs").write_text("4242\n")  # the daemon itself, as systemd started it
    return svc


def test_v2_detect_and_delegated_layout(tmp_path):
    root = tmp_path / "cg"
    svc = _fake_v2(root)
    (svc / "cgroup.procs").write_text(f"{os.getpid()}\n")  # the daemon, as systemd started it
    assert cgroups.detect(root) == 2
    assert cgroups.detect(tmp_path / "nothing") is None
    drv = CgroupV2(root, base="/system.slice/dlshare-node.service", group="dlshare/n1")
    drv.delegated = True  # systemd Delegate=yes: the daemon owns its service cgroup
    g = drv.apply(CgroupLimits("job-a", cpus=1.5, cpuset="0-1", memory_bytes=1 << 30), [])
    assert g == svc / "dlshare" / "n1" / "job-a"
    # no internal processes: the daemon moved to its own leaf before controllers were enabled
    assert (svc / "dlshare-n1.daemon" / "cgroup.procs").read_text() == str(os.getpid())
    for level in (svc, svc / "dlshare", svc / "dlshare" / "n1"):
        assert (level / "cgroup.subtree_control").read_text() == "+cpu +cpuset +memory"
    assert (g / "cpu.max").read_text() == "150000 100000"
    assert (g / "cpuset.cpus").read_text() == "0-1"
    assert (g / "memory.max").read_text() == str(1 << 30)
    assert (g / "memory.high").read_text() == str(int((1 << 30) * 0.95))
    # the root was not touched in delegated mode
    assert (root / "cgroup.subtree_control").read_text() == ""


def test_v2_two_daemons_in_one_cgroup_keep_separate_groups(tmp_path):
    root = tmp_path / "cg"
    _fake_v2(root)
    a = CgroupV2(root, base="/shared", group="dlshare/node-1")
    b = CgroupV2(root, base="/shared", group="dlshare/node-2")
    ga = a.apply(CgroupLimits("train-0", cpus=1.0))
    gb = b.apply(CgroupLimits("train-0", cpus=2.0))
    assert ga != gb
    assert (ga / "cpu.max").read_text() == "100000 100000" and (gb / "cpu.max").read_text() == "200000 100000"
    a.release("train-0")
    assert not ga.exists() and gb.exists()  # one node's release leaves the other's job alone


def test_v2_swap_is_closed_when_the_kernel_has_it(tmp_path):
    root = tmp_path / "cg"
    _fake_v2(root)
    drv = CgroupV2(root, base="/d")
    g = drv.path("j")
    g.mkdir(parents=True)
    (g / "memory.swap.max").write_text("max")
    drv.apply(CgroupLimits("j", memory_bytes=64 << 20))
    assert (g / "memory.swap.max").read_text() == "0"


def test_v2_explicit_base_enables_controllers_down_the_path(tmp_path):
    root = tmp_path / "cg"
    _fake_v2(root)
    drv = CgroupV2(root, base="/dlshare")
    drv.apply(CgroupLimits("j", cpus=None, memory_bytes=None), [111])
    assert "+memory" in (root / "cgroup.subtree_control").read_text()
    g = root / "dlshare" / "dlshare" / "j"
    assert (g / "cpu.max").read_text() == "max 100000"
    assert (g / "memory.max").read_text() == "max"
    assert (g / "cgroup.procs").read_text() == "111"
    drv.release("j")
    assert not g.exists()
    assert (root / "dlshare" / "dlshare.daemon" / "cgroup.procs").read_text() == "111"
    # an empty group left by an earlier run is removed at start
    (root / "dlshare" / "dlshare" / "stale").mkdir()
    assert drv.cleanup_stale() == 1


def test_v2_oom_events_counted(tmp_path):
    root = tmp_path / "cg"
    _fake_v2(root)
    drv = CgroupV2(root, base="/dlshare")
    drv.apply(CgroupLimits("j", memory_bytes=64 << 20))
    (drv.path("j") / "memory.events").write_text("low 0\nhigh 3\nmax 9\noom 1\noom_kill 1\n")
    assert drv.oom_kills("j") == 1


def test_no_cgroups_refuses_with_reason(tmp_path):
    d = cgroups.driver(str(tmp_path / "none"))
    assert d.version == 0
    with pytest.raises(cgroups.CgroupError, match="no cgroup hierarchy"):
        d.apply(CgroupLimits("j", cpus=1))
