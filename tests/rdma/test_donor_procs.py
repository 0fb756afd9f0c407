"""The test helpers' view of a stopped process (tests/rdma/donors.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from nodesvc.bus.procs import wait_until
from tests.rdma.donors import threads_stopped

THREADS = "import threading\n" \
          "for _ in range(3): threading.Thread(target=threading.Event().wait, daemon=True).start()\n" \
          "print('up', flush=True)\n" \
          "while True: pass\n"


def test_a_process_counts_as_stopped_once_every_thread_has_stopped():
    proc = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(os.listdir(f"/proc/{proc.pid}/task")) >= 4 and not threads_stopped(proc.pid)  # busy, running
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: threads_stopped(proc.pid), 30, "every thread to stop")
        os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: not threads_stopped(proc.pid), 30, "the threads to run again")
    finally:
        proc.kill()
        proc.wait(10)
