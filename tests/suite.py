"""``make test``: the suite on several workers, then the tests that must run alone.

Most of the suite waits (for daemons to start, for a broker's message, for a timeout it checks), so
one pytest process left a 2-core machine about 60% idle.  This runs it in two passes::

    python -m tests.suite [--workers N] [pytest args...]

1. every test not marked ``alone``, on N pytest-xdist workers (default 3), each test file on one
   worker (``--dist loadfile``: a file's module fixtures start once), each worker in a network
   namespace and cgroups of its own (tests/isolate.py);
2. the tests marked ``alone`` (tests/conftest.py, ``ALONE``, with the reason for each), one at a
   time in this machine's own namespace, as the whole suite ran before.

Pass 1 does not collect the ``ALONE`` files (``--ignore``); pass 2 collects only them when the args
name no test path (collecting the whole tree to keep 128 of 1,558 tests took 17.6 s, the ALONE files
alone 8.6 s, with warm bytecode caches).

``--workers 1``, or a machine where workers cannot be isolated (not root, no network namespaces:
the reason is printed), runs everything in one pytest process.  A ``-m EXPR`` among the pytest
args narrows both passes.  The exit status is the first failing pass's (a pass with nothing
selected counts as passed), else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Collection

from tests import isolate

NO_TESTS = 5  # pytest's exit status when a selection holds no test


def _marks(user: str | None, ours: str) -> list[str]:
    return ["-m", f"({user}) and {ours}" if user else ours]


def pass_args(rest: list[str], alone: Collection[str]) -> tuple[list[str], list[str]]:
    """Each pass's pytest args from the caller's ``rest``: pass 1 ignores the ``alone`` files; pass 2
    names them, unless ``rest`` names a test path of its own (then it keeps the caller's choice)."""
    first = [*rest, *(f"--ignore={f}" for f in sorted(alone))]
    named = any(not a.startswith("-") and os.path.exists(a.split("::")[0]) for a in rest)
    return first, [*rest] if named else [*rest, *sorted(alone)]


def _run(argv: list[str], what: str) -> tuple[int, float]:
    print(f"\n=== {what}: {' '.join(argv[2:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(argv)
    return (0 if rc == NO_TESTS else rc), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--workers", type=int, default=3,
                    help="pytest-xdist workers for the first pass (1: one process, no second pass)")
    ap.add_argument("-m", dest="marks", default=None, help="pytest's -m, applied to both passes")
    a, rest = ap.parse_known_args(argv)
    pytest = [sys.executable, "-m", "pytest"]
    why = isolate.available() if a.workers > 1 else "one worker asked for"
    if why:
        print(f"suite: one pytest process ({why})", flush=True)
        rc, _ = _run([*pytest, *(["-m", a.marks] if a.marks else []), *rest], "the suite")
        return rc
    from tests.conftest import ALONE

    first, second = pass_args(rest, ALONE)
    isolate.remove_worker_cgroups()  # what a run killed before its end left behind
    worker = f"popen//python={sys.executable} -m tests.isolate"
    try:
        rc1, t1 = _run([*pytest, "--dist", "loadfile", "--tx", f"{a.workers}*{worker}",
                        *_marks(a.marks, "not alone"), *first], f"pass 1 of 2, on {a.workers} isolated workers")
    finally:
        isolate.remove_worker_cgroups(wait_s=30)  # the workers may still be exiting when pytest returns
    rc2, t2 = _run([*pytest, *_marks(a.marks, "alone"), *second], "pass 2 of 2, the tests that run alone")
    print(f"\nsuite: pass 1 {'passed' if rc1 == 0 else f'FAILED ({rc1})'} in {t1:.0f} s, "
          f"pass 2 {'passed' if rc2 == 0 else f'FAILED ({rc2})'} in {t2:.0f} s, {t1 + t2:.0f} s in all", flush=True)
    return rc1 or rc2


if __name__ == "__main__":
    sys.exit(main())
