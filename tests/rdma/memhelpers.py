"""Helpers for remote-memory integration tests: donor node processes on a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

from nodesvc.bus.procs import stop_proc  # noqa: E402,F401


SLAB = 1 << 20  # tests use 1 MiB slabs


class DonorProc:
    """A donor node as a separate process (``python -m nodesvc.daemon.donor_shell``)."""

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
            cmd = [sys.executable, "-m", "nodesvc.daemon.donor_shell", "--broker", broker, "--node-id", node, "--interval", "0.3"]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

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


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)


def recv_exact(s, n: int) -> bytes:
    """Exactly n bytes from socket s (ConnectionError if it closes first)."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf
