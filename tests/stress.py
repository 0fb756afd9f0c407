"""``make test-stress``: the test suite (or a selection) with one core held busy, repeated.

A flaky test is usually a race that a quiet machine hides: a wait too short for a loaded CI runner,
a precondition that depends on which process the scheduler runs first.  This runs pytest while a
busy loop holds one core (pinned to CPU 0, started here and stopped by pid), ``--count N`` times per
test (pytest-repeat)::

    python -m tests.stress [--count N] [--no-hog] [pytest args...]

The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

# The busy loop ends by itself once this process is gone (killed with SIGKILL, say): it checks its
# parent every few milliseconds, so a stress run stopped any way leaves no core busy behind it.
# Its argument is the parent's pid (read at start, the parent could already be gone).
HOG = ("import os, sys\nos.sched_setaffinity(0, {0})\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
       "    for _ in range(100_000):\n        pass\n")


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # SIGTERM, SIGHUP: through the finally below


def _stop_tests(tests: subprocess.Popen) -> None:
    """Stopped from outside: pytest stops too, by SIGINT (its teardowns run), else SIGTERM, else SIGKILL."""
    for send, wait_s in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if tests.poll() is not None:
            return
        tests.send_signal(send)
        try:
            tests.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1, help="run each selected test this many times")
    ap.add_argument("--no-hog", action="store_true", help="repeat without the busy core")
    a, rest = ap.parse_known_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    hog = None if a.no_hog else subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())],
                                                  start_new_session=True)
    tests = None
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", *(["--count", str(a.count)] if a.count > 1 else []), *rest]
        print("stress:", "one core busy (pid %d)," % hog.pid if hog else "no hog,", " ".join(cmd), flush=True)
        # SIGINT as pytest's default (a shell's background job inherits it ignored), for the stop below
        tests = subprocess.Popen(cmd, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        return tests.wait()
    finally:
        if tests is not None:
            _stop_tests(tests)
        if hog is not None:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
