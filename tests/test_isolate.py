"""The test workers' isolation (tests/isolate.py) and the suite's split (tests/suite.py, conftest ALONE)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nodesvc.bus.procs import wait_until
from tests import isolate
from tests.conftest import ALONE, ROOT

# The isolated child binds PORT (held in this namespace) and reports its network namespace and cgroups.
PROBE = """
import json, os, socket, sys
port = int(sys.argv[1])
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen()
c = socket.create_connection(("127.0.0.1", port), timeout=5)
c.close()
print(json.dumps({"pid": os.getpid(), "net": os.readlink("/proc/self/ns/net"),
                  "cgroup": open("/proc/self/cgroup").read()}))
"""

_WHY_NOT = isolate.available()
needs_isolation = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


@needs_isolation
def test_a_worker_gets_its_own_loopback_and_cgroups_and_they_are_removed_after_it():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # held here: the worker binds the same port in its own namespace
    taken.listen()
    port = taken.getsockname()[1]
    with taken:
        r = subprocess.run([sys.executable, "-m", "tests.isolate", "-c", PROBE, str(port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["net"] != os.readlink("/proc/self/ns/net")
    if not isolate._v1():
        return
    theirs = {}
    for line in seen["cgroup"].splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            theirs[c] = path
    ours = isolate._own_v1()
    groups = []
    for c in ("cpu", "memory"):
        assert theirs[c] == f"{ours[c].rstrip('/')}/{isolate.PREFIX}{seen['pid']}", (c, theirs[c])
        groups.append(isolate.CGROUP_ROOT / c / theirs[c].lstrip("/"))
    assert all(g.is_dir() for g in groups)
    (groups[0] / "dlshare" / "n1" / "j1").mkdir(parents=True)  # as a node daemon of the worker leaves them
    assert isolate.remove_worker_cgroups() >= len(groups) + 3
    assert not any(g.exists() for g in groups)


@needs_isolation
def test_a_live_workers_cgroups_are_left_alone_and_an_ending_one_is_waited_for(tmp_path):
    ready, go = tmp_path / "ready", tmp_path / "go"
    code = (f"import pathlib, time\npathlib.Path({str(ready)!r}).write_text('1')\n"
            f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.05)\ntime.sleep(0.5)\n")
    p = subprocess.Popen([sys.executable, "-m", "tests.isolate", "-c", code], cwd=ROOT)
    try:
        wait_until(lambda: ready.exists() or p.poll() is not None, timeout=60, what="the isolated child to start")
        assert p.poll() is None, "the isolated child ended early"
        if not isolate._v1():
            return
        mine = [isolate.CGROUP_ROOT / c / r.lstrip("/") / f"{isolate.PREFIX}{p.pid}" for c, r in isolate._own_v1().items()]
        (mine[0] / "dlshare" / "n1").mkdir(parents=True)
        isolate.remove_worker_cgroups()
        assert all(g.is_dir() for g in mine) and (mine[0] / "dlshare" / "n1").is_dir()
        go.write_text("1")  # it ends half a second later, and is not reaped here (a zombie) until the end
        assert isolate.remove_worker_cgroups(wait_s=60) >= len(mine) + 2
        assert not any(g.exists() for g in mine)
    finally:
        p.kill()
        p.wait()


def test_every_file_kept_alone_exists_and_says_why():
    for rel, why in ALONE.items():
        assert (ROOT / rel).is_file() and rel.startswith("tests/") and rel.endswith(".py"), rel
        assert len(why) > 10, rel


@needs_isolation
def test_the_two_passes_run_each_selected_test_once_and_fail_when_either_fails(tmp_path):
    """tests/suite.py on a throwaway tree: one ALONE-marked test fails, so the run fails, and every
    other test ran exactly once across the passes."""
    t = tmp_path / "t"
    t.mkdir()
    (t / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n"
        "        if 'alone' in item.name:\n"
        "            item.add_marker(pytest.mark.alone)\n")
    log = tmp_path / "ran"
    body = f"def _ran(name):\n    open({str(log)!r}, 'a').write(name + '\\n')\n"
    for i in range(4):
        body += f"def test_{i}():\n    _ran('{i}')\n"
    body += "def test_alone_ok():\n    _ran('alone_ok')\ndef test_alone_fails():\n    _ran('alone_fails')\n    assert False\n"
    (t / "test_x.py").write_text(body)
    r = subprocess.run([sys.executable, "-m", "tests.suite", "--workers", "2", "-q", "-p", "no:cacheprovider",
                        "-o", "markers=alone: x", "--rootdir", str(t), "-c", os.devnull, str(t)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    ran = sorted(Path(log).read_text().split())
    assert ran == sorted(["0", "1", "2", "3", "alone_ok", "alone_fails"]), r.stdout
    assert r.returncode == 1, r.stdout
    assert "pass 2 FAILED" in r.stdout


class _Item:
    def __init__(self, rel: str, name: str) -> None:
        self.path, self.nodeid, self.marks = ROOT / rel, f"{rel}::{name}", []

    def add_marker(self, mark) -> None:
        self.marks.append(mark.name)


def test_items_sharing_a_node_id_are_refused_unless_their_file_runs_alone():
    """pytest-xdist keeps one item per node id: two items under one id outside ALONE stop the run."""
    from tests import conftest

    alone = next(iter(ALONE))
    ok = [_Item("tests/test_isolate.py", "a"), _Item("tests/test_isolate.py", "b"), _Item(alone, "x"), _Item(alone, "x")]
    conftest.pytest_collection_modifyitems(None, ok)
    assert [i.marks for i in ok] == [[], [], ["alone"], ["alone"]]
    with pytest.raises(pytest.UsageError, match="share a node id.*test_isolate.py::a"):
        conftest.pytest_collection_modifyitems(None, [_Item("tests/test_isolate.py", "a")] * 2)


def test_where_workers_cannot_be_isolated_the_suite_runs_in_one_process_and_says_why(tmp_path, monkeypatch, capfd):
    from tests import suite

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = isolate.available()
    assert why and "needs root" in why
    (tmp_path / "test_y.py").write_text("def test_y():\n    pass\n")
    rc = suite.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)])
    out = capfd.readouterr().out
    assert rc == 0, out
    assert f"suite: one pytest process ({why})" in out
    assert "1 passed" in out and "pass 1 of 2" not in out


@needs_isolation
def test_a_cgroup_v2_host_runs_the_suite_in_one_process(tmp_path, monkeypatch):
    """Node daemons there would make real v2 groups named by node id, shared by both workers."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    monkeypatch.setattr(isolate, "CGROUP_ROOT", tmp_path)
    assert "cgroup v2" in (isolate.available() or "")


def test_pass_one_ignores_the_alone_files_and_pass_two_names_them_unless_the_args_name_a_path():
    from tests.suite import pass_args

    alone = ["tests/test_stress.py", "tests/rdma/test_remote.py"]
    first, second = pass_args(["-q", "-k", "fast", "--durations=0"], alone)
    assert first == ["-q", "-k", "fast", "--durations=0", "--ignore=tests/rdma/test_remote.py",
                     "--ignore=tests/test_stress.py"]
    assert second == ["-q", "-k", "fast", "--durations=0", "tests/rdma/test_remote.py", "tests/test_stress.py"]
    # a path (or a node id) named by the caller: pass 2 keeps the caller's selection
    for named in ("tests/rdma", "tests/rdma/test_remote.py::test_standalone_donor_shell_serves_consumers"):
        first, second = pass_args(["-q", named], alone)
        assert second == ["-q", named] and first[:2] == ["-q", named]
