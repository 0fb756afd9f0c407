"""Applying job allocations (CPU quota, cpuset, memory limit) through cgroups v1 or v2.

Both drivers place a job's processes in ``<base>/<job>`` where ``<base>`` is a
``dlshare`` group under the daemon's own cgroup, so the daemon stays inside what
its supervisor delegated to it (systemd ``Delegate=yes``, or a container's
cgroup) instead of writing at the root of the hierarchy.

- v2 (unified): ``cpu.max``, ``cpuset.cpus``/``cpuset.mems``, ``memory.max``,
  ``memory.high`` and ``memory.swap.max`` (0, so a job over its limit is stopped, not swapped).  Controllers are enabled down the path through
  ``cgroup.subtree_control``; because of the no-internal-processes rule, the
  daemon moves itself (and nothing else) into a ``<group>.daemon`` leaf first,
  as systemd delegation requires.  Job groups are ``<top>/<group>/<job>``.
- v1 (one hierarchy per controller): ``cpu.cfs_quota_us``/``cpu.cfs_period_us``,
  ``cpuset.cpus``/``cpuset.mems``, ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` when swap accounting exists, so the limit is
  not escaped through swap).

A process that exceeds ``memory_bytes`` is killed by the kernel's OOM killer
(v1: ``memory.oom_control`` counts it; v2: ``memory.events`` ``oom_kill``).

``apply`` is all or nothing: when a step fails (a cpuset the node lacks, a process the kernel
will not move), the groups it made are removed, the limits it changed are written back and the
processes it moved go back where they were.  Each driver remembers where every process it moved
came from, and ``release`` puts it back there (a process forked inside the group goes where its
job's first process came from); where that group is gone, or the daemon restarted since, the
process goes to the daemon's own cgroup (v1) or its daemon leaf (v2).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dlshare.cgroups")

CFS_PERIOD_US = 100_000  # the kernel default period


class CgroupError(RuntimeError):
    """A cgroup operation failed; the message names the file."""


@dataclass(frozen=True)
class CgroupLimits:
    """The limits one job's cgroup enforces on this node, as an ``allocate`` or ``run`` command asks."""

    job: str
    cpus: float | None = None  # CPU quota in cores (0.5 = half a core)
    cpuset: str | None = None  # e.g. "0-3,8"
    memory_bytes: int | None = None


def parse_cpuset(text: str) -> list[int]:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; raises ValueError on malformed lists."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo_s, hi_s = part.split("-", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 0 or hi < lo or hi - lo > 65535:
                raise ValueError(f"bad cpu range {part!r}")
            cpus.update(range(lo, hi + 1))
        else:
            c = int(part)
            if c < 0:
                raise ValueError(f"bad cpu {part!r}")
            cpus.add(c)
    return sorted(cpus)


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(value)
    except OSError as exc:
        raise CgroupError(f"writing {value!r} to {path}: {os.strerror(exc.errno or 0)}") from exc


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise CgroupError(f"reading {path}: {os.strerror(exc.errno or 0)}") from exc


class _Change:
    """What one ``apply`` did so far, to undo if a later step fails: groups it made, files it
    rewrote (with their old contents), processes it moved (with where they were)."""

    def __init__(self, kernel_file: str) -> None:
        self.kernel_file = kernel_file
        self.made: list[Path] = []
        self.rewritten: list[tuple[Path, str]] = []
        self.moved: list[tuple[Path, str]] = []  # (the cgroup.procs it came from, pid)
        self.new_origins: list[tuple[str, int]] = []  # (job, pid) first recorded by this apply

    def mkdir(self, g: Path) -> None:
        if not g.is_dir():
            g.mkdir()
            self.made.append(g)

    def write(self, path: Path, value: str) -> None:
        if path.parent not in self.made and path.exists():
            self.rewritten.append((path, _read(path)))
        _write(path, value)

    def undo(self, origins: dict[str, dict[int, dict[str, str]]]) -> None:
        for procs, pid in reversed(self.moved):
            try:
                _write(procs, pid)
            except CgroupError as exc:
                log.warning("undoing a failed allocation: %s", exc)
        for path, old in reversed(self.rewritten):
            try:
                _write(path, old)
            except CgroupError as exc:
                log.warning("undoing a failed allocation: %s", exc)
        for g in reversed(self.made):
            try:
                _remove_group(g, self.kernel_file)
            except CgroupError as exc:
                log.warning("undoing a failed allocation: %s", exc)
        for job, pid in self.new_origins:
            origins.get(job, {}).pop(pid, None)


def detect(root: str | os.PathLike[str] = "/sys/fs/cgroup") -> int | None:
    """2 for a unified (v2) hierarchy, 1 for v1 controllers, None when neither is usable."""
    r = Path(root)
    if (r / "cgroup.controllers").exists():
        return 2
    if (r / "cpu").is_dir() or (r / "memory").is_dir():
        return 1
    return None


def own_cgroup(version: int, proc_self: str = "/proc/self/cgroup") -> dict[str, str]:
    """The daemon's own cgroup path per controller ("" key for v2)."""
    out: dict[str, str] = {}
    try:
        lines = Path(proc_self).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if version == 2 and hid == "0":
            out[""] = path
        elif version == 1 and ctrls:
            for c in ctrls.split(","):
                out[c] = path
    return out


class CgroupV2:
    version = 2
    controllers = ("cpu", "cpuset", "memory")

    def __init__(self, root: str | os.PathLike[str] = "/sys/fs/cgroup", base: str | None = None,
                 memory_high_ratio: float = 0.95, group: str = "dlshare") -> None:
        self.root = Path(root)
        # Delegated mode (base None): our own cgroup, as systemd Delegate=yes hands it to us.
        # Explicit base: a group we create, enabling controllers from the root down.
        self.delegated = base is None
        rel = own_cgroup(2).get("", "/") if base is None else base
        self.top = self.root / rel.lstrip("/")
        # Daemons sharing one cgroup (dlshare up) each get their own group and daemon leaf.
        self.base = self.top / group
        self.leaf = self.top / (group.replace("/", "-") + ".daemon")
        self.memory_high_ratio = memory_high_ratio
        self.origins: dict[str, dict[int, dict[str, str]]] = {}  # job -> pid -> {"": its cgroup before}
        self._ready = False

    def _enable(self, node: Path) -> None:
        ctl = node / "cgroup.controllers"
        avail = set(_read(ctl).split()) if ctl.exists() else set(self.controllers)
        want = " ".join("+" + c for c in self.controllers if c in avail)
        try:
            _write(node / "cgroup.subtree_control", want)
        except CgroupError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EBUSY:
                raise CgroupError(
                    f"{node} holds other processes, so controllers cannot be enabled below it; "
                    "run the daemon with systemd Delegate=yes (see deploy/dlshare-node.service)"
                ) from exc
            raise

    def _prepare(self) -> None:
        if self._ready:
            return
        self.top.mkdir(parents=True, exist_ok=True)
        if not self.delegated:
            for node in [p for p in reversed(self.top.parents) if p.is_relative_to(self.root)]:
                self._enable(node)
        # No internal processes: the daemon moves itself (only itself) to a leaf
        # before controllers are enabled below top.  Other processes in top make
        # that fail with a clear error rather than being moved behind their back.
        self.leaf.mkdir(exist_ok=True)
        top_procs = self.top / "cgroup.procs"
        if top_procs.exists() and str(os.getpid()) in _read(top_procs).split():
            _write(self.leaf / "cgroup.procs", str(os.getpid()))
        self._enable(self.top)
        node = self.top
        for part in self.base.relative_to(self.top).parts:
            node = node / part
            node.mkdir(exist_ok=True)
            self._enable(node)
        self._ready = True

    def path(self, job: str) -> Path:
        return self.base / job

    def apply(self, alloc: CgroupLimits, pids: list[int] = ()) -> Path:
        self._prepare()
        change = _Change("cgroup.events")
        try:
            g = self.path(alloc.job)
            change.mkdir(g)
            if alloc.cpuset is not None:
                change.write(g / "cpuset.cpus", alloc.cpuset)
            if alloc.cpus is not None:
                quota = max(1000, int(alloc.cpus * CFS_PERIOD_US))
                change.write(g / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            else:
                change.write(g / "cpu.max", f"max {CFS_PERIOD_US}")
            if alloc.memory_bytes is not None:
                high = int(alloc.memory_bytes * self.memory_high_ratio)
                change.write(g / "memory.high", str(high))
                change.write(g / "memory.max", str(int(alloc.memory_bytes)))
                if (g / "memory.swap.max").exists():
                    change.write(g / "memory.swap.max", "0")  # over the limit means stopped, not swapped
            else:
                change.write(g / "memory.high", "max")
                change.write(g / "memory.max", "max")
                if (g / "memory.swap.max").exists():
                    change.write(g / "memory.swap.max", "max")
            self.add_pids(alloc.job, pids, change)
        except BaseException:
            change.undo(self.origins)
            raise
        return g

    def _procs(self, controller: str, path: str) -> Path:
        return self.root / path.lstrip("/") / "cgroup.procs"

    def add_pids(self, job: str, pids, change: _Change | None = None) -> None:
        for pid in pids:
            origin = own_cgroup(2, f"/proc/{int(pid)}/cgroup")
            try:
                _write(self.path(job) / "cgroup.procs", str(int(pid)))
            except CgroupError as exc:
                if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESRCH:
                    continue  # exited meanwhile
                raise
            _moved(self, job, int(pid), origin, change)

    def pids(self, job: str) -> list[int]:
        f = self.path(job) / "cgroup.procs"
        if not f.exists():
            return []
        return [int(x) for x in _read(f).split()]

    def cleanup_stale(self) -> int:
        """Remove empty job groups an earlier run left behind; returns how many."""
        return _cleanup(self.base)

    def oom_kills(self, job: str) -> int:
        return _oom_kill_count(self.path(job) / "memory.events")

    def release(self, job: str) -> None:
        origins = self.origins.pop(job, {})
        g = self.path(job)
        if not g.exists():
            return
        _empty_and_remove(g, lambda pid: _homes(self, origins, pid, "") + [self.leaf / "cgroup.procs"],
                          kernel_file="cgroup.events")


class CgroupV1:
    version = 1
    controllers = ("cpu", "cpuset", "memory")

    def __init__(self, root: str | os.PathLike[str] = "/sys/fs/cgroup", base: str | None = None,
                 group: str = "dlshare") -> None:
        self.root = Path(root)
        own = own_cgroup(1)
        self.bases: dict[str, Path] = {}
        for c in self.controllers:
            mount = self.root / c
            if not mount.is_dir():
                continue
            rel = (base if base is not None else own.get(c, "/").rstrip("/") + "/" + group).lstrip("/")
            self.bases[c] = mount / rel
        if "cpu" not in self.bases and "memory" not in self.bases:
            raise CgroupError(f"no cgroup v1 cpu or memory controller under {self.root}")
        # Where a process with no known origin goes on release: the daemon's own cgroups.
        self.fallback = {c: self._procs(c, own.get(c, "/")) for c in self.bases}
        self.origins: dict[str, dict[int, dict[str, str]]] = {}  # job -> pid -> controller -> its cgroup before
        self._ready = False

    def _prepare(self) -> None:
        if self._ready:
            return
        for c, b in self.bases.items():
            b.mkdir(parents=True, exist_ok=True)
            if c == "cpuset":
                # cpuset groups start empty; every level needs cpus and mems before tasks join.
                self._inherit_cpuset(b)
        self._ready = True

    def _inherit_cpuset(self, g: Path) -> None:
        mount = self.root / "cpuset"
        chain = [g, *[p for p in g.parents if p.is_relative_to(mount) and p != mount]]
        for node in reversed(chain):
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (node / f).exists() and not _read(node / f):
                    _write(node / f, _read(node.parent / f))

    def path(self, job: str, controller: str = "cpu") -> Path:
        return self.bases[controller] / job

    def apply(self, alloc: CgroupLimits, pids: list[int] = ()) -> dict[str, Path]:
        self._prepare()
        change = _Change("tasks")
        try:
            out = self._apply(alloc, change)
            self.add_pids(alloc.job, pids, change)
        except BaseException:
            change.undo(self.origins)
            raise
        return out

    def _apply(self, alloc: CgroupLimits, change: _Change) -> dict[str, Path]:
        out = {}
        for c, b in self.bases.items():
            g = b / alloc.job
            change.mkdir(g)
            out[c] = g
        if "cpu" in out:
            g = out["cpu"]
            change.write(g / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            quota = -1 if alloc.cpus is None else max(1000, int(alloc.cpus * CFS_PERIOD_US))
            change.write(g / "cpu.cfs_quota_us", str(quota))
        if "cpuset" in out:
            g = out["cpuset"]
            self._inherit_cpuset(g)
            if alloc.cpuset is not None:
                change.write(g / "cpuset.cpus", alloc.cpuset)
        if "memory" in out:
            g = out["memory"]
            limit = -1 if alloc.memory_bytes is None else int(alloc.memory_bytes)
            memsw = g / "memory.memsw.limit_in_bytes"
            if limit == -1:
                if memsw.exists():
                    change.write(memsw, "-1")
                change.write(g / "memory.limit_in_bytes", "-1")
            else:
                # memsw must stay >= the memory limit: lower the memory limit first, raise memsw after.
                try:
                    change.write(g / "memory.limit_in_bytes", str(limit))
                    if memsw.exists():
                        change.write(memsw, str(limit))
                except CgroupError:
                    if memsw.exists():
                        change.write(memsw, str(limit))
                    change.write(g / "memory.limit_in_bytes", str(limit))
        return out

    def _procs(self, controller: str, path: str) -> Path:
        return self.root / controller / path.lstrip("/") / "cgroup.procs"

    def add_pids(self, job: str, pids, change: _Change | None = None) -> None:
        for pid in pids:
            origin = own_cgroup(1, f"/proc/{int(pid)}/cgroup")
            moved: dict[str, str] = {}
            for c, b in self.bases.items():
                try:
                    _write(b / job / "cgroup.procs", str(int(pid)))
                except CgroupError as exc:
                    if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESRCH:
                        break
                    _moved(self, job, int(pid), moved, change)  # undo the controllers it did join
                    raise
                if c in origin:
                    moved[c] = origin[c]
            else:
                _moved(self, job, int(pid), moved, change)

    def pids(self, job: str) -> list[int]:
        for b in self.bases.values():
            f = b / job / "cgroup.procs"
            if f.exists():
                return [int(x) for x in _read(f).split()]
        return []

    def cleanup_stale(self) -> int:
        return sum(_cleanup(b) for b in self.bases.values())

    def oom_kills(self, job: str) -> int:
        b = self.bases.get("memory")
        return _oom_kill_count(b / job / "memory.oom_control") if b else 0

    def release(self, job: str) -> None:
        origins = self.origins.pop(job, {})
        for c, b in self.bases.items():
            g = b / job
            if g.exists():
                _empty_and_remove(g, lambda pid, c=c: _homes(self, origins, pid, c) + [self.fallback[c]],
                                  kernel_file="tasks")


class NoCgroups:
    """Used where no cgroup hierarchy is writable: allocations are refused with the reason."""

    version = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def apply(self, alloc: CgroupLimits, pids=()):
        raise CgroupError(f"cgroups unavailable: {self.reason}")

    def add_pids(self, job: str, pids) -> None:
        raise CgroupError(f"cgroups unavailable: {self.reason}")

    def pids(self, job: str) -> list[int]:
        return []

    def oom_kills(self, job: str) -> int:
        return 0

    def cleanup_stale(self) -> int:
        return 0

    def release(self, job: str) -> None:
        return None


def _oom_kill_count(f: Path) -> int:
    """The ``oom_kill`` line of v2 ``memory.events`` or v1 ``memory.oom_control`` (0 when absent)."""
    if not f.exists():
        return 0
    for line in _read(f).splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


def _moved(drv, job: str, pid: int, origin: dict[str, str], change: _Change | None) -> None:
    """Record where ``pid`` was before it joined ``job`` (the first time only: a process moved
    twice into the same job came from where it was before the first move)."""
    known = drv.origins.setdefault(job, {})
    if pid not in known:
        known[pid] = dict(origin)
        if change is not None:
            change.new_origins.append((job, pid))
    if change is not None:
        change.moved.extend((drv._procs(c, path), str(pid)) for c, path in origin.items())


def _homes(drv, origins: dict[int, dict[str, str]], pid: int, controller: str) -> list[Path]:
    """Where a released process goes for one controller: where it came from, else where its
    job's first process came from (a child forked in the group)."""
    origin = origins.get(pid) or next(iter(origins.values()), {})
    path = origin.get(controller)
    return [drv._procs(controller, path)] if path is not None else []


def _empty_and_remove(g: Path, targets, kernel_file: str) -> None:
    """Move the group's processes out (each to the first of ``targets(pid)`` that takes it), then
    remove the group.

    ``kernel_file`` is one the kernel always creates in a group; where it is
    missing this is a fake tree (tests), whose regular files must go first.
    """
    procs = g / "cgroup.procs"
    for pid in (_read(procs).split() if procs.exists() else []):
        for target in targets(int(pid)):
            if target.parent == g:
                continue
            try:
                _write(target, pid)
                break
            except CgroupError:
                continue
        else:
            log.warning("could not move pid %s out of %s", pid, g)
    _remove_group(g, kernel_file)


def _remove_group(g: Path, kernel_file: str) -> None:
    try:
        g.rmdir()
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY and not (g / kernel_file).exists():
            for f in g.iterdir():
                f.unlink()
            g.rmdir()
        else:
            raise CgroupError(f"removing {g}: {os.strerror(exc.errno or 0)}") from exc


def _cleanup(base: Path) -> int:
    """rmdir every empty job group under base (a group with processes is left alone)."""
    n = 0
    if not base.is_dir():
        return 0
    for g in base.iterdir():
        if not g.is_dir() or g.name.endswith(".daemon"):
            continue
        procs = g / "cgroup.procs"
        if procs.exists() and _read(procs):
            log.warning("cgroup %s still has processes; leaving it", g)
            continue
        try:
            g.rmdir()
            n += 1
        except OSError:
            continue  # a fake tree's regular files, or a group with children
    return n


def driver(root: str = "/sys/fs/cgroup", base: str | None = None, version: int | None = None,
           group: str = "dlshare"):
    """The driver for this node: v2 if unified, v1 if legacy, else :class:`NoCgroups`.

    ``group`` names the v1 group under the daemon's own cgroups (daemons sharing
    a host, as under ``dlshare up``, each get their own); v2 uses the delegated
    cgroup itself unless ``base`` is given.
    """
    v = version or detect(root)
    try:
        if v == 2:
            return CgroupV2(root, base, group=group)
        if v == 1:
            return CgroupV1(root, base, group)
    except CgroupError as exc:
        return NoCgroups(str(exc))
    return NoCgroups(f"no cgroup hierarchy at {root}")
