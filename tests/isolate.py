"""A test worker's own network namespace and cgroups, so that two workers of ``make test`` never meet.

``python -m tests.isolate ARGS...`` moves this process into a new network namespace (its loopback
up, with a second IPv4 address) and, on a cgroup v1 host, into cgroups of its own under its
current ones (``cpu``, ``cpuset``, ``memory``: the controllers a node daemon uses), then replaces
itself by ``python ARGS...``.  tests/suite.py starts each pytest-xdist worker through it
(``--tx popen//python=PYTHON -m tests.isolate``), so that what one worker's tests start cannot reach
or collide with what the other's do:

- **ports.** Every daemon a test starts listens on loopback: a port chosen by ``free_port()`` and
  then bound by a child, a port a daemon gives up and takes again after a restart, the fixed
  defaults some daemons bind (the aggregation server's metrics, kube-scheduler's health port).  In
  a namespace of its own, only the worker's own processes can take them;
- **cgroups.** A node daemon puts its jobs under ``<its own cgroup>/dlshare/<node id>/<job id>``;
  tests name nodes ``n1`` and jobs ``j1`` freely, and a daemon starting up removes the empty job
  groups it finds there.  Under a cgroup of its own per worker, each worker's daemons have their own.

Left shared, and handled by running those tests alone after the workers (tests/conftest.py,
``ALONE``): named network namespaces (``/run/netns``), and the load one worker puts on the other's
deadlines.

This needs root (a new network namespace, cgroup writes) and cgroup v1 or none; :func:`available`
says why not, and the suite then runs in one process as before.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuset", "memory")
WORKER_ADDR = "192.0.2.1/32"  # TEST-NET-1 (RFC 5737): never routed anywhere
PREFIX = "dlshare-test-worker-"  # the worker cgroups' names: PREFIX + the worker's pid


def available() -> str | None:
    """None when workers can be isolated here, else why not."""
    if os.geteuid() != 0:
        return "isolating test workers needs root (a network namespace and cgroups of their own)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if not shutil.which(tool):
            return f"the {tool} command ({package}) is needed to give a worker a network namespace"
    probe = subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up && ip addr add {WORKER_ADDR} dev lo"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip() or probe.returncode}"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        # Node daemons would make real v2 groups named by node id, and a v2 worker group would have to
        # follow the no-internal-processes rule around the runner: not built.
        return "cgroup v2 here: the workers' node daemons would share cgroups (only v1 is isolated)"
    if _v1():  # the same steps as a worker's, on a group that no process joins
        made: list[Path] = []
        try:
            for c, rel in _own_v1().items():
                made.append(_make_group(c, rel, f"{PREFIX}probe-{os.getpid()}"))
        except OSError as exc:
            return f"cannot make a worker its own cgroups here: {exc}"
        finally:
            for g in made:
                g.rmdir()
    return None


def _own_v1() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            if c in CONTROLLERS:
                out[c] = path
    return out


def _v1() -> bool:
    return all((CGROUP_ROOT / c).is_dir() for c in ("cpu", "memory")) and not (CGROUP_ROOT / "cgroup.controllers").exists()


def enter_own_cgroups(pid: int) -> list[Path]:
    """Move process ``pid`` into new v1 cgroups ``PREFIX<pid>`` under its current ones; the groups made.
    Nothing on a host without cgroup v1 (its node-daemon tests use fake trees or no enforcement)."""
    if not _v1():
        return []
    made = []
    for c, rel in _own_v1().items():
        g = _make_group(c, rel, f"{PREFIX}{pid}")
        made.append(g)
        (g / "cgroup.procs").write_text(str(pid))
    return made


def _make_group(controller: str, parent: str, name: str) -> Path:
    g = CGROUP_ROOT / controller / parent.lstrip("/") / name
    g.mkdir(exist_ok=True)
    if controller == "cpuset":  # a cpuset group starts empty: a task may join only once it has cpus and mems
        for f in ("cpuset.cpus", "cpuset.mems"):
            (g / f).write_text((g.parent / f).read_text())
    return g


def _alive(pid: str) -> bool:
    """The process runs (a zombie has left its cgroups already)."""
    try:
        stat = Path("/proc", pid, "stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] != "Z"


def remove_worker_cgroups(wait_s: float = 0.0) -> int:
    """Remove the worker cgroups under this process's own cgroups whose worker is gone, bottom up with
    what its node daemons left inside; the number of groups removed.  A worker still alive is waited
    for up to ``wait_s`` (the runner's own, just told to end), then its groups are left alone, and so
    is a group that still holds a process (for the next run's clean-up)."""
    if not _v1():
        return 0
    deadline = time.monotonic() + wait_s
    n = 0
    for c, rel in _own_v1().items():
        parent = CGROUP_ROOT / c / rel.lstrip("/")
        for top in parent.glob(f"{PREFIX}*"):
            pid = top.name[len(PREFIX):]
            if not pid.isascii() or not pid.isdigit():
                continue
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                continue
            for d, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(d)
                    n += 1
                except OSError:
                    pass  # a process still inside: left for the next run
    return n


def _unshare_net() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # An IPv4 address besides 127.0.0.1, as every host has: getaddrinfo() with AI_ADDRCONFIG (slurmctld's
    # listening socket) finds no IPv4 address without one.  On lo, from the documentation range.
    subprocess.run(["ip", "addr", "add", WORKER_ADDR, "dev", "lo"], check=True)


def main(argv: list[str]) -> None:
    _unshare_net()
    enter_own_cgroups(os.getpid())
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
