"""The processes a node daemon runs or manages for jobs, and their usage.

A job started with ``run`` is its own process group (session), placed in its
cgroup *before* it executes the job's program: a small ``/bin/sh`` trampoline
writes its pid into the job's ``cgroup.procs`` files and then ``exec``s the
program, so no child escapes the allocation by forking early.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger("dlshare.jobs")

_TRAMPOLINE = 'IFS=:; for f in $DLSHARE_CGROUP_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'


@dataclass
class JobProcess:
    job: str
    popen: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)  # adopted pids (allocate with pids)
    # start time of each adopted pid: a pid is signalled only while it is still that process
    pid_started: dict[int, float] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()
    started: float = field(default_factory=time.time)
    exit_code: int | None = None
    exited_at: float | None = None
    log_path: str | None = None
    memory_bytes: int | None = None
    run_id: str = ""  # the run command's run_id, echoed in the exit event and telemetry
    last_usage: dict = field(default_factory=dict)
    _ps: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return "exited" if self.exit_code is not None else "running"

    def root_pids(self) -> list[int]:
        return ([self.popen.pid] if self.popen else []) + list(self.pids)

    def all_pids(self) -> list[int]:
        out: list[int] = []
        for pid in self.root_pids():
            try:
                p = psutil.Process(pid)
                out.append(pid)
                out.extend(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                continue
        return out

    def usage(self) -> dict:
        """CPU percent (since the last call) and RSS of the job's whole process tree."""
        cpu = 0.0
        rss = 0
        live: dict[int, psutil.Process] = {}
        for pid in self.all_pids():
            p = self._ps.get(pid)
            try:
                if p is None:
                    p = psutil.Process(pid)
                    p.cpu_percent(None)  # first call primes the counter
                else:
                    cpu += p.cpu_percent(None)
                rss += p.memory_info().rss
                live[pid] = p
            except psutil.Error:
                continue
        self._ps = live
        self.last_usage = {"cpu_percent": round(cpu, 1), "rss_bytes": rss, "pids": sorted(live)}
        return self.last_usage


def tgid_of(pid: int) -> int | None:
    """The thread group (process) of task ``pid``, which may be a thread id; None when no such
    task exists (any more).  /proc/<tid> resolves thread ids too, though it does not list them."""
    try:
        with open(f"/proc/{int(pid)}/status") as fh:
            for line in fh:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (mode 0700) or check that an existing one is ours and private.

    Job logs are written there as root; a directory another user could
    prepare with symlinks would let them redirect those writes.
    """
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not os.path.isdir(p) or os.path.islink(p):
        raise RuntimeError(f"state directory {p} is not a plain directory")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"state directory {p} must be owned by uid {os.geteuid()} and not group/world-writable")
    return p


class JobTable:
    def __init__(self, state_dir: str) -> None:
        self.state_dir = Path(state_dir)
        self.jobs: dict[str, JobProcess] = {}

    def start(self, job: str, argv: list[str], env: dict[str, str], cwd: str | None,
              cgroup_procs: list[str], gpus: tuple[int, ...] = (), run_id: str = "") -> JobProcess:
        cur = self.jobs.get(job)
        if cur is not None and cur.state == "running":
            raise RuntimeError(f"job {job} is already running (pid {cur.root_pids()})")
        private_dir(self.state_dir)
        log_path = self.state_dir / f"{job}.log"
        full_env = {**os.environ, **env, "DLSHARE_JOB": job, "DLSHARE_CGROUP_PROCS": ":".join(cgroup_procs)}
        if gpus:
            full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "ab") as out:
            popen = subprocess.Popen(
                ["/bin/sh", "-c", _TRAMPOLINE, "dlshare-job", *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=cwd or None, env=full_env, start_new_session=True,
            )
        jp = JobProcess(job=job, popen=popen, gpus=tuple(gpus), log_path=str(log_path), run_id=run_id)
        self.jobs[job] = jp
        log.info("started job %s pid %d: %s", job, popen.pid, " ".join(argv))
        return jp

    def adopt(self, job: str, pids: list[int], memory_bytes: int | None) -> JobProcess:
        jp = self.jobs.get(job)
        if jp is None or jp.state == "exited":
            jp = JobProcess(job=job)
            self.jobs[job] = jp
        for pid in pids:
            try:
                jp.pid_started[pid] = psutil.Process(pid).create_time()
            except psutil.Error:
                continue  # already gone
        jp.pids = sorted(set(jp.pids) | set(jp.pid_started))
        jp.memory_bytes = memory_bytes
        return jp

    def _same_process(self, jp: JobProcess, pid: int) -> bool:
        try:
            return psutil.Process(pid).create_time() == jp.pid_started.get(pid)
        except psutil.Error:
            return False

    def signal(self, job: str, sig: int, members: list[int] = ()) -> list[int]:
        """Signal the job: its process group, its adopted pids (if still the same
        processes) and ``members`` (its cgroup's processes, which catches children
        that left the group)."""
        jp = self.jobs.get(job)
        if jp is None:
            raise KeyError(job)
        sent = []
        if jp.popen and jp.popen.poll() is None:
            try:
                os.killpg(jp.popen.pid, sig)
                sent.append(jp.popen.pid)
            except ProcessLookupError:
                pass
        for pid in [p for p in jp.pids if self._same_process(jp, p)] + [p for p in members if p not in sent]:
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sorted(set(sent))

    def reap(self) -> list[JobProcess]:
        """Jobs whose processes ended since the last call."""
        ended = []
        for jp in self.jobs.values():
            if jp.exit_code is not None:
                continue
            if jp.popen is not None:
                rc = jp.popen.poll()
                if rc is not None:
                    jp.exit_code, jp.exited_at = rc, time.time()
                    ended.append(jp)
            elif jp.pids and not any(self._same_process(jp, p) for p in jp.pids):
                jp.exit_code, jp.exited_at = 0, time.time()
                ended.append(jp)
        return ended

    def forget_exited(self, older_than_s: float = 300.0) -> None:
        now = time.time()
        for job in [j for j, p in self.jobs.items() if p.exited_at and now - p.exited_at > older_than_s]:
            del self.jobs[job]

    def stop_all(self, timeout: float = 5.0) -> None:
        """Stop the jobs this daemon started; adopted processes (allocate with pids) are not ours to stop."""
        for jp in self.jobs.values():
            if jp.popen is not None and jp.popen.poll() is None:
                try:
                    os.killpg(jp.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + timeout
        for jp in self.jobs.values():
            if jp.popen is not None:
                try:
                    jp.popen.wait(timeout=max(0.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(jp.popen.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    jp.popen.wait()
