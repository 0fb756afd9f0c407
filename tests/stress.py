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

HOG = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1, help="run each selected test this many times")
    ap.add_argument("--no-hog", action="store_true", help="repeat without the busy core")
    a, rest = ap.parse_known_args(argv)
    hog = None if a.no_hog else subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-ra", *(["--count", str(a.count)] if a.count > 1 else []), *rest]
        print("stress:", "one core busy (pid %d)," % hog.pid if hog else "no hog,", " ".join(cmd), flush=True)
        return subprocess.call(cmd)
    finally:
        if hog is not None:
            os.killpg(hog.pid, signal.SIGKILL)
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
