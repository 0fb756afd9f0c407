"""The processes a node daemon runs or manages for jobs, and their usage.

A job started with ``run`` is its own process group (session), placed in its
cgroup *before* it executes the job's program, and run as its owner: between
fork and exec the child writes its pid into the job's ``cgroup.procs`` files,
drops to the owner's uid, gid and groups and enters its working directory
(:mod:`nodesvc.daemon.runas`), so no child escapes the allocation by forking
early and nothing of the job runs as root.  Each job has its own directory
(``<job_dir>/<job>``, the user's, mode 0700) with its log, ``job.log``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nodesvc.daemon.runas import JobCredentials, child_setup, job_root, prepare_job_dir

log = logging.getLogger("dlshare.jobs")

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
    user: str = ""  # whom it runs as (adopted processes: "")
    uid: int | None = None
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


class JobTable:
    """The jobs of one daemon.  ``state_dir`` holds ``jobs/`` (or ``job_dir``), the root of the
    jobs' own directories."""

    def __init__(self, state_dir: str, job_dir: str = "", clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall time, for when a job exited and when it is forgotten (a test moves it by hand)."""
        self.state_dir = Path(state_dir)
        self.job_dir = Path(job_dir) if job_dir else self.state_dir / "jobs"
        self.jobs: dict[str, JobProcess] = {}
        self.clock = clock

    def start(self, job: str, argv: list[str], env: dict[str, str], cwd: str | None,
              cgroup_procs: list[str], creds: JobCredentials, gpus: tuple[int, ...] = (),
              run_id: str = "") -> JobProcess:
        """Start ``argv`` as ``creds`` with exactly ``env`` (the caller builds it: see
        :func:`~nodesvc.daemon.runas.job_environment`), in ``cwd`` or the job's own directory."""
        cur = self.jobs.get(job)
        if cur is not None and cur.state == "running":
            raise RuntimeError(f"job {job} is already running (pid {cur.root_pids()})")
        if not self.job_dir.is_relative_to(self.state_dir) or self.job_dir == self.state_dir:
            job_root(self.job_dir)
        else:
            job_root(self.state_dir)  # users pass through it to their job's directory
            job_root(self.job_dir)
        workdir, fd = prepare_job_dir(self.job_dir, job, creds)
        try:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=child_setup(creds, cgroup_procs, cwd or str(workdir)),
            )
        finally:
            os.close(fd)
        log_path = workdir / "job.log"
        jp = JobProcess(job=job, popen=popen, gpus=tuple(gpus), log_path=str(log_path), run_id=run_id,
                        user=creds.user, uid=creds.uid)
        self.jobs[job] = jp
        log.info("started job %s pid %d as %s (uid %d): %s", job, popen.pid, creds.user, creds.uid, " ".join(argv))
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
                    jp.exit_code, jp.exited_at = rc, self.clock()
                    ended.append(jp)
            elif jp.pids and not any(self._same_process(jp, p) for p in jp.pids):
                jp.exit_code, jp.exited_at = 0, self.clock()
                ended.append(jp)
        return ended

    def forget_exited(self, older_than_s: float = 300.0) -> None:
        now = self.clock()
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
