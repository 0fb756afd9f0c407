"""bench/slurm.py's pieces without a cluster: the scaled trace, the speed table, the job emulator, the logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import slurm as bs
from nodesvc.bus.procs import wait_until

ROOT = Path(__file__).resolve().parents[3]


def test_scaled_trace_spans_the_arrivals_and_keeps_the_order():
    trace, scale = bs.scaled_trace(20, 30.0, 2.0)
    assert len(trace) == 20 and abs(max(t.arrival_s for t in trace) - 30.0) < 1e-6
    assert all(t.duration_s >= 2.0 for t in trace) and 0 < scale < 1
    assert [t.arrival_s for t in trace] == sorted(t.arrival_s for t in trace)


def test_scaled_trace_with_a_load_asks_that_many_gpu_seconds():
    trace, scale = bs.scaled_trace(20, 30.0, 0.0, load=1.5, gpus_total=16)
    plain, scale2 = bs.scaled_trace(20, 30.0, 0.0)
    assert scale == scale2 and [t.arrival_s for t in trace] == [t.arrival_s for t in plain]
    asked = sum(t.gpus * t.duration_s for t in trace)
    assert abs(asked / (30.0 * 16) - 1.5) < 1e-9
    assert asked > 1.5 * sum(t.gpus * t.duration_s for t in plain)  # the trace's own factor: far less load


def test_speed_table_is_the_simulators_ground_truth():
    trace, _ = bs.scaled_trace(20, 30.0, 2.0)
    table = bs.speed_table(trace)
    kinds = {bs._type_key(t) for t in trace}
    assert set(table) == kinds and all(set(v) == kinds for v in table.values())
    assert all(0 < s <= 1.0 for v in table.values() for s in v.values())


def workload(d: Path, work: float, job: str, gpus: str = "", node: str = "n1") -> subprocess.Popen:
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURMD_NODENAME": node, "DLSHARE_GPUS": gpus}
    return subprocess.Popen([sys.executable, "-m", "bench.slurm_workload", "--type", "A", "--work", str(work),
                             "--dir", str(d)], cwd=ROOT, env=env)


def _done(d: Path, job: str) -> float:
    try:
        return json.loads((d / "progress" / job).read_text())["done"]
    except (OSError, ValueError, KeyError):
        return 0.0


def test_workload_progresses_resumes_after_a_requeue_and_slows_when_sharing(tmp_path):
    (tmp_path / "speeds.json").write_text(json.dumps({"A": {"A": 0.5}}))
    p = workload(tmp_path, 60.0, "7", gpus="0")
    wait_until(lambda: _done(tmp_path, "7") >= 0.5, 60, "job 7 to make progress")
    p.send_signal(signal.SIGTERM)  # a requeue: progress kept
    assert p.wait(10) == 143
    done = _done(tmp_path, "7")
    assert 0.5 <= done < 60.0
    # it resumes from its checkpoint; a job sharing its GPU halves its speed meanwhile
    (tmp_path / "progress" / "7").write_text(json.dumps({"done": 58.5, "ended": False}))
    other = workload(tmp_path, 600.0, "8", gpus="0")
    gpu = tmp_path / "gpus" / "n1-0"
    wait_until(lambda: gpu.is_dir() and any(f.name.startswith("8.") for f in gpu.iterdir()), 60,
               "job 8 registered on GPU 0")  # the sharing, by construction
    t0 = time.time()
    p = workload(tmp_path, 60.0, "7", gpus="0")
    assert p.wait(60) == 0
    took = time.time() - t0
    other.send_signal(signal.SIGTERM)
    other.wait(10)
    # 1.5 s of work at half speed (progress counts wall time, so a loaded machine only adds to it)
    assert took > 2.9, took
    starts, ends, twice = bs._events(tmp_path)
    assert len(starts["7"]) == 2 and "7" in ends and not twice
    assert not list(gpu.iterdir())  # registrations removed on exit


def test_a_run_after_the_end_counts_as_run_twice(tmp_path):
    (tmp_path / "speeds.json").write_text(json.dumps({}))
    assert workload(tmp_path, 0.3, "9").wait(30) == 0
    assert workload(tmp_path, 0.3, "9").wait(30) == 0
    _, ends, twice = bs._events(tmp_path)
    assert twice == {"9"}


def test_release_lines_are_read_from_the_shell_log(tmp_path):
    log = tmp_path / "dlshare.log"
    log.write_text("2026-11-22 23:00:34,702 INFO    dlshare.slurm: slurm: released job 17: placed on n1 GPU 0 (3 CPUs)\n"
                   "2026-11-22 23:00:35,000 WARNING dlshare.slurm: slurm: job 18: scontrol update failed (exit 1)\n")
    rel = bs._releases(log)
    assert list(rel) == ["17"] and abs(rel["17"][0] % 1 - 0.702) < 1e-6
    assert bs._count(log, r"failed \(exit") == 1
