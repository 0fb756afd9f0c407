"""Fixtures for remote-memory integration tests: donor node processes on a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def stop_proc(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

SLAB = 1 << 20  # tests use 1 MiB slabs


class DonorProc:
    """A donor node as a separate process (``python -m nodesvc.donor``)."""

    def __init__(self, node: str, broker: str, tmp: Path, slab_bytes: int = SLAB, max_slabs: int = 64,
                 deadline_s: float = 2.0) -> None:
        self.node = node
        self.log_path = tmp / f"donor-{node}.log"
        cmd = [sys.executable, "-m", "nodesvc.donor", "--broker", broker, "--node-id", node,
               "--slab-bytes", str(slab_bytes), "--max-slabs", str(max_slabs), "--headroom-bytes", str(64 << 20),
               "--interval", "0.3", "--reclaim-deadline-s", str(deadline_s)]
        self.log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
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


@pytest.fixture
def donor_factory(tmp_path):
    procs: list[DonorProc] = []

    def start(broker_url: str, n: int, prefix: str = "donor", **kw) -> list[DonorProc]:
        new = [DonorProc(f"{prefix}{len(procs) + i}", broker_url, tmp_path, **kw) for i in range(n)]
        procs.extend(new)
        return new

    yield start
    for p in procs:
        stop_proc(p.proc)


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
