"""tests/stress.py leaves no core busy behind it, however it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from nodesvc.bus.procs import wait_until
from tests.conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_busy_core_ends_when_the_stress_run_is_killed():
    """SIGKILL skips every finally: the busy loop notices its parent is gone by itself."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "from tests.stress import HOG\n"
                               "import os\n"
                               "p = subprocess.Popen([sys.executable, '-c', HOG, str(os.getpid())],\n"
                               "                     start_new_session=True)\n"
                               "print(p.pid, flush=True)\ntime.sleep(60)\n"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    hog = int(parent.stdout.readline())
    try:
        assert _alive(hog)
        parent.kill()
        parent.wait(timeout=10)
        wait_until(lambda: not _alive(hog), 10, "the busy loop ended after its parent was killed")
    finally:
        if _alive(hog):
            os.kill(hog, signal.SIGKILL)


def test_sigterm_stops_the_tests_and_the_busy_core(tmp_path):
    marker = tmp_path / "started"
    (tmp_path / "test_waits.py").write_text(
        "import os, time\n"
        f"def test_waits():\n    open({str(marker)!r}, 'w').write(str(os.getpid()))\n    time.sleep(120)\n")
    # SIGINT ignored, as a shell's background job (CI's, say) inherits it: the stop must not depend on it
    run = subprocess.Popen([sys.executable, "-m", "tests.stress", "-p", "no:randomly", "-p", "no:cacheprovider",
                            str(tmp_path / "test_waits.py")], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        hog = int(run.stdout.readline().split("(pid ")[1].split(")")[0])
        wait_until(lambda: marker.exists() and marker.read_text(), 60, "the selected test running")
        pytest_pid = int(marker.read_text())
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        assert not _alive(hog) and not _alive(pytest_pid)
        assert "KeyboardInterrupt" in run.stdout.read()  # pytest stopped by SIGINT, its teardowns run
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
