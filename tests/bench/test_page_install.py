"""bench/page_install.c (the kernel's cost of installing and dropping a unit, RESULTS issue 21) builds
warning-free and every mode runs to its figures; a mode the kernel lacks fails with its reason."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "bench" / "page_install.c"


@pytest.fixture(scope="module")
def tool(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: run `make deps`")
    out = tmp_path_factory.mktemp("page_install") / "page_install"
    r = subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(SRC)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("mode", ["copy", "memfd", "memfd-pop", "move", "evict-inplace", "evict-move", "evict-batch",
                                  "copy spin", "move spin"])
def test_each_mode_prints_its_costs_per_page(tool, mode):
    r = subprocess.run([str(tool), *mode.split()], capture_output=True, text=True, timeout=120)
    if mode.startswith(("move", "evict-move")) and r.returncode and "UFFDIO_API" in r.stderr:
        pytest.skip(f"this kernel has no UFFDIO_MOVE (Linux 6.8+): {r.stderr.strip()}")
    if mode == "evict-batch" and r.returncode and "process_madvise" in r.stderr:
        pytest.skip(f"this kernel refuses MADV_DONTNEED through process_madvise: {r.stderr.strip()}")
    if (mode.startswith("evict") or mode.endswith("spin")) and r.returncode and "needs 2 CPUs" in r.stderr:
        pytest.skip("one CPU: no other CPU to interrupt")
    assert r.returncode == 0, r.stderr
    m = re.search(r"receive\s+(\d+)\s+install\s+(\d+)\s+drop\s+(\d+)\s+total\s+(\d+)", r.stdout)
    name = mode.split()[0]
    assert m and r.stdout.startswith(name) and ("(spin)" in r.stdout) == mode.endswith("spin"), r.stdout
    recv, install, drop, total = map(int, m.groups())
    assert install > 0 and drop > 0 and abs(recv + install + drop - total) <= 2, r.stdout


def test_an_unknown_mode_is_refused_with_the_usage(tool):
    r = subprocess.run([str(tool), "nonsense"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
