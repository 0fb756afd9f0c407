"""The node daemon's pure core: command validation and idempotence, no I/O.

:func:`parse_op` turns a :class:`~nodesvc.bus.messages.Command` into a typed spec
or raises :class:`~nodesvc.bus.messages.PayloadError` with a message for the
sender.  :class:`ReplyCache` makes commands idempotent: a command id seen
before gets the same reply again, without applying anything twice (the
scheduler replays commands after a restart).
"""

from __future__ import annotations

import re
import signal as _signal
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nodesvc.cgroups import CgroupLimits, parse_cpuset
from nodesvc.bus.messages import Command, PayloadError, arg, check_id

MAX_ARGV = 256
MAX_RUN_ID = 256
MAX_ARG_LEN = 4096
MAX_ENV = 256
MAX_PIDS = 4096
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")  # as useradd takes them (and the scheduler's tokens)


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class AllocateSpec:
    alloc: CgroupLimits
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReleaseSpec:
    job: str


@dataclass(frozen=True)
class RunSpec:
    job: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    alloc: CgroupLimits | None = None
    gpus: tuple[int, ...] = ()
    remote_memory_bytes: int | None = None  # donor memory the job may borrow (every copy counted)
    run_id: str = ""  # the sender's name for this run, echoed in the job's exit (tells runs of one job apart)
    user: str | None = None  # whom it runs as (resolved on the node); None: the daemon's own user


@dataclass(frozen=True)
class StopSpec:
    job: str
    signal: int = int(_signal.SIGTERM)


BUILTIN_OPS = ("ping", "allocate", "release", "run", "stop")


def _alloc(args: dict[str, Any], job: str) -> CgroupLimits:
    cpus = arg(args, "cpus", (int, float), required=False)
    if cpus is not None and not (0.01 <= cpus <= 4096):
        raise PayloadError(f"cpus must be between 0.01 and 4096 cores, got {cpus}")
    cpuset = arg(args, "cpuset", str, required=False)
    if cpuset is not None:
        try:
            cores = parse_cpuset(cpuset)
        except ValueError as exc:
            raise PayloadError(f"cpuset {cpuset!r} is not a CPU list like '0-3,8': {exc}") from None
        if not cores:
            raise PayloadError("cpuset must name at least one CPU")
    mem = arg(args, "memory_bytes", int, required=False)
    if mem is not None and not (1 << 20 <= mem <= 1 << 50):
        raise PayloadError(f"memory_bytes must be between 1 MiB and 1 PiB, got {mem}")
    return CgroupLimits(job=job, cpus=cpus, cpuset=cpuset, memory_bytes=mem)


def _job(args: dict[str, Any]) -> str:
    return check_id(arg(args, "job", str), "job id")


def parse_op(cmd: Command, protected_pids: frozenset[int] = frozenset({1})) -> Any:
    """Validate a built-in command's arguments into a spec.

    ``protected_pids`` (init, the daemon and its ancestors) may never be put
    under an allocation: a 1 MiB limit on them would be a remote kill switch.
    """
    a = cmd.args
    if cmd.op == "ping":
        return Ping()
    if cmd.op == "allocate":
        job = _job(a)
        pids = arg(a, "pids", list, required=False, default=[])
        if len(pids) > MAX_PIDS or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 1 << 31 for p in pids):
            raise PayloadError(f"pids must be a list of at most {MAX_PIDS} positive process ids")
        bad = sorted(set(pids) & protected_pids)
        if bad:
            raise PayloadError(f"pids {bad} are init, the node daemon or its ancestors and cannot be allocated")
        return AllocateSpec(_alloc(a, job), tuple(pids))
    if cmd.op == "release":
        return ReleaseSpec(_job(a))
    if cmd.op == "run":
        job = _job(a)
        argv = arg(a, "argv", list)
        if not argv or len(argv) > MAX_ARGV or not all(isinstance(x, str) and 0 < len(x) <= MAX_ARG_LEN for x in argv):
            raise PayloadError(f"argv must be a non-empty list of at most {MAX_ARGV} non-empty strings")
        if "\x00" in "".join(argv):
            raise PayloadError("argv must not contain NUL characters")
        env = arg(a, "env", dict, required=False, default={})
        if len(env) > MAX_ENV or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\x00" not in k + v
            for k, v in env.items()
        ):
            raise PayloadError("env must map variable names (no '=' or NUL) to strings")
        cwd = arg(a, "cwd", str, required=False)
        gpus = arg(a, "gpus", list, required=False, default=[])
        if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024 for g in gpus):
            raise PayloadError("gpus must be a list of GPU indices")
        has_alloc = any(k in a for k in ("cpus", "cpuset", "memory_bytes"))
        remote = arg(a, "remote_memory_bytes", int, required=False)
        if remote is not None and not (0 <= remote <= 1 << 50):
            raise PayloadError(f"remote_memory_bytes must be between 0 and 1 PiB, got {remote}")
        run_id = arg(a, "run_id", str, required=False, default="")
        if len(run_id) > MAX_RUN_ID or not run_id.isprintable():
            raise PayloadError(f"run_id must be at most {MAX_RUN_ID} printable characters")
        if cwd is not None and (not cwd.startswith("/") or "\x00" in cwd or len(cwd) > MAX_ARG_LEN):
            raise PayloadError("cwd must be an absolute path without NUL characters")
        user = arg(a, "user", str, required=False)
        if user is not None and not _USER.match(user):
            raise PayloadError(f"user {user[:64]!r} is not a user name (1-32 characters of A-Z a-z 0-9 _ . -, "
                               "not starting with a digit, '.' or '-')")
        return RunSpec(job, tuple(argv), dict(env), cwd, _alloc(a, job) if has_alloc else None, tuple(gpus),
                       remote or None, run_id, user)
    if cmd.op == "stop":
        job = _job(a)
        sig = arg(a, "signal", (int, str), required=False, default="SIGTERM")
        if isinstance(sig, str):
            name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
            if name not in ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGSTOP", "SIGCONT"):
                raise PayloadError(f"unsupported signal {sig!r}")
            sig = int(getattr(_signal, name))
        elif not 1 <= sig <= 31:
            raise PayloadError(f"signal must be 1-31, got {sig}")
        return StopSpec(job, sig)
    raise PayloadError(f"unknown op {cmd.op!r}")


def thread_groups(pids: tuple[int, ...], tgid_of: dict[int, int | None],
                  protected_pids: frozenset[int]) -> tuple[int, ...]:
    """The processes an allocate of ``pids`` moves: each id resolved to its thread group
    (``tgid_of``, read by the shell from /proc; None: no such task any more, dropped).

    A thread id written to ``cgroup.procs`` moves its whole process, so ids are checked as
    processes: a thread of init, the daemon or an ancestor is refused like the process.
    """
    out: set[int] = set()
    for pid in pids:
        tgid = tgid_of.get(pid)
        if tgid is None:
            continue
        if tgid in protected_pids:
            which = f"pid {pid}" if tgid == pid else f"thread {pid} of process {tgid}"
            raise PayloadError(f"{which} is init, the node daemon or one of its ancestors "
                               f"(process {tgid}) and cannot be allocated")
        out.add(tgid)
    return tuple(sorted(out))


class ReplyCache:
    """Bounded memory of replies by command id (oldest forgotten first)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._d: OrderedDict[str, bytes] = OrderedDict()

    def get(self, cmd_id: str) -> bytes | None:
        r = self._d.get(cmd_id)
        if r is not None:
            self._d.move_to_end(cmd_id)
        return r

    def put(self, cmd_id: str, reply: bytes) -> None:
        self._d[cmd_id] = reply
        self._d.move_to_end(cmd_id)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)
