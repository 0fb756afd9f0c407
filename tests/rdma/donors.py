"""Donor node processes on a real broker, for remote-memory integration tests (see conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from nodesvc.bus.procs import stop_proc, wait_until

ROOT = Path(__file__).resolve().parents[2]
SLAB = 1 << 20  # tests use 1 MiB slabs


class DonorProc:
    """A donor node as a separate process."""

    def __init__(self, node: str, broker: str, tmp: Path, slab_bytes: int = SLAB, max_slabs: int = 64,
                 deadline_s: float = 2.0, shell: str = "daemon") -> None:
        """``shell``: "daemon" runs the real node daemon (``dlshare node`` with lend = true);
        "donor" the donor-only shell (``python -m nodesvc.daemon.donor_shell``)."""
        self.node = node
        self.log_path = tmp / f"donor-{node}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   DLSHARE_DONOR_SLAB_BYTES=str(slab_bytes), DLSHARE_DONOR_MAX_SLABS=str(max_slabs),
                   DLSHARE_DONOR_HEADROOM_BYTES=str(64 << 20), DLSHARE_DONOR_RECLAIM_DEADLINE_S=str(deadline_s))
        if shell == "daemon":
            cmd = [sys.executable, "-m", "nodesvc.cli", "node", "--node-id", node, "--broker", broker]
            env.update(DLSHARE_NODE_LEND="1", DLSHARE_NODE_ENFORCE="0", DLSHARE_NODE_INTERVAL="0.3",
                       DLSHARE_NODE_METRICS_LISTEN="127.0.0.1:-1", DLSHARE_NODE_STATE_DIR=str(tmp / f"state-{node}"))
        else:
            cmd = [sys.executable, "-m", "nodesvc.daemon.donor_shell", "--broker", broker, "--node-id", node,
                   "--interval", "0.3"]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread has stopped: kill() returns before a thread running on
        another CPU (or on a vCPU its host has descheduled) takes the signal, and until then it may
        still answer a request (a suite run with one core held busy saw a ping answered after it)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: threads_stopped(self.pid), 30, f"every thread of donor {self.node} to stop")

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        stop_proc(self.proc)
        self.log.close()

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/TID/stat)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(s in ("T", "t") for s in states)
