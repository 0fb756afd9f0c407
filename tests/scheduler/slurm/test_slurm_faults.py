"""Faults with a real Slurm: kill -9 of `dlshare slurm`, slurmctld restarts, a slurmd down and back.

Every job appends a line when it starts and another when it ends, so "lost" (never ran to its end)
and "run twice" (two starts without a requeue between them) are read from what really ran.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nodesvc.bus.procs import stop_proc, wait_until
from scheduler.slurm.shell_log import ShellLog
from tests.scheduler.slurm.conftest import drive, make_shell

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def submit(c, log: Path, gpus: int, secs: float, name: str = "ResNet-18@32") -> str:
    script = (f'echo "start $SLURM_JOB_ID $SLURMD_NODENAME ${{SLURM_RESTART_COUNT:-0}}" >> {log}; sleep {secs}; '
              f'echo "end $SLURM_JOB_ID" >> {log}')
    return c.sbatch("-p", c.partition, f"--gres=gpu:{gpus}", "-J", name, "-o", "/dev/null", "--wrap", script)


def runs(log: Path) -> tuple[dict[str, list[tuple[str, int]]], dict[str, int]]:
    starts: dict[str, list[tuple[str, int]]] = {}
    ends: dict[str, int] = {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        f = line.split()
        if f[0] == "start":
            starts.setdefault(f[1], []).append((f[2], int(f[3])))
        else:
            ends[f[1]] = ends.get(f[1], 0) + 1
    return starts, ends


def releases_in_slurm_log(c, ids) -> dict[str, int]:
    text = (c.root / "log" / "slurmctld.log").read_text()
    return {j: len(re.findall(rf"release hold on JobId={j} by uid", text)) for j in ids}


def all_completed(c, ids) -> bool:
    return all(c.job(j).get("job_state") == "COMPLETED" for j in ids)


def dlshare_slurm(c, journal: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nodesvc.cli", "slurm", "--slurm-conf", str(c.conf), "--journal", str(journal),
           "--profile", "fifo", "--predictors", "default", "--poll", "0.3", "--partition", c.partition,
           "--gpu-slots", str(c.gpu_slots)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_kill9_of_dlshare_slurm_loses_nothing_and_runs_nothing_twice(slurm, tmp_path):
    c = slurm
    log = tmp_path / "runs"
    rng = random.Random(15)
    ids = [submit(c, log, rng.choice([1, 1, 1, 2, 4]), rng.uniform(1.0, 4.0)) for _ in range(18)]
    journal = tmp_path / "journal"
    proc = dlshare_slurm(c, journal, tmp_path / "dlshare.log")
    kills = 0
    try:
        for delay in (1.5, 2.5, 3.0):  # kill -9 while it is releasing, and again later
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
            proc = dlshare_slurm(c, journal, tmp_path / "dlshare.log")
        wait_until(lambda: all_completed(c, ids), timeout=120, what="every job completed", interval=0.5)
    finally:
        stop_proc(proc)
    starts, ends = runs(log)
    assert kills == 3
    assert {j: len(starts.get(j, [])) for j in ids} == {j: 1 for j in ids}, "a job ran twice or never"
    assert {j: ends.get(j, 0) for j in ids} == {j: 1 for j in ids}
    # Slurm's own record of every hold released (the journal's "rel" lines are intents written before the
    # scontrol call; a kill between the two makes the next process do it, once)
    assert releases_in_slurm_log(c, ids) == {j: 1 for j in ids}, "a job was released twice or never"
    assert set(r["id"] for r in ShellLog(journal).load() if r["t"] == "rel") == set(ids)


def test_slurmctld_restart_while_dlshare_runs(slurm, tmp_path):
    c = slurm
    log = tmp_path / "runs"
    sh = make_shell(c, tmp_path, "fifo")
    stop = threading.Event()
    t = threading.Thread(target=sh.run, args=(stop,), daemon=True)
    t.start()
    try:
        first = [submit(c, log, 4, 4.0) for _ in range(4)]  # three run, one waits for GPUs
        wait_until(lambda: len(runs(log)[0]) == 3, timeout=30, what="three jobs running")
        c.stop_ctld()
        wait_until(lambda: sh.stats.unavailable > 0, timeout=30, what="the shell finding slurmctld gone")
        c.start_ctld()
        later = [submit(c, log, 1, 1.0) for _ in range(4)]
        ids = first + later
        wait_until(lambda: all_completed(c, ids), timeout=120, what="every job completed", interval=0.5)
    finally:
        stop.set()
        t.join(timeout=20)
    starts, ends = runs(log)
    assert {j: len(starts[j]) for j in ids} == {j: 1 for j in ids}
    assert all(ends[j] == 1 for j in ids)
    assert not t.is_alive()


def test_slurmd_down_and_back_requeues_and_places_again(slurm, tmp_path):
    c = slurm
    log = tmp_path / "runs"
    sh = make_shell(c, tmp_path, "fifo")
    a = submit(c, log, 4, 300.0, "LM@20")
    drive(sh, lambda: a in runs(log)[0], what="the job running")
    node = runs(log)[0][a][0][0]
    c.stop_node(node)  # kill -9 of its slurmd: the node stops answering
    # Slurm declares it down after SlurmdTimeout and requeues the job; dlshare holds it, the core drops the
    # node and places the job on another one
    drive(sh, lambda: len(runs(log)[0].get(a, [])) >= 2, timeout=90, what="the job running again elsewhere")
    (_, (again, restarts)) = runs(log)[0][a]
    assert again != node and restarts >= 1
    assert not sh.core.nodes[node].alive
    assert sh.core.records[a].shards[0].node == again
    c.start_node(node)
    drive(sh, lambda: sh.core.nodes[node].alive, timeout=90, what="the node back in the core")
    b = submit(c, log, 4, 300.0, "LM@20")
    drive(sh, lambda: b in runs(log)[0], timeout=30, what="a job on the returned capacity")
    sh.close()


def test_taking_dlshare_out_releases_held_jobs_with_their_own_requests(slurm, tmp_path):
    c = slurm
    log = tmp_path / "runs"
    sh = make_shell(c, tmp_path, "fifo")
    ids = [c.sbatch("-p", c.partition, "--gres=gpu:4", "-c", "2", "--mem=1000", "-J", "LM@20", "-o", "/dev/null",
                    "--wrap", f'echo "start $SLURM_JOB_ID $SLURMD_NODENAME 0" >> {log}; sleep 300') for _ in range(5)]
    drive(sh, lambda: len(runs(log)[0]) == 3, what="three running")
    sh.close()
    held = [j for j in ids if c.job(j)["priority"] == 0]
    assert len(held) == 2 and all("dlshare: waiting" in c.job(j)["comment"] or c.job(j)["comment"] == ""
                                  for j in held)
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "slurm", "--release-held", "--slurm-conf", str(c.conf),
                          "--journal", str(tmp_path / "journal"), "--partition", c.partition],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "released 2 jobs" in out.stdout
    for j in held:
        rec = c.job(j)
        assert rec["priority"] != 0 and rec["cpus"] == 2 and rec["memory_per_node"] == 1000
        assert rec["comment"] == "" and rec["admin_comment"] == ""


def test_job_submit_lua_holds_jobs_of_the_partition_only(slurm, tmp_path):
    c = slurm
    held = c.sbatch("-p", c.partition, "--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 30")
    free = c.sbatch("--gres=gpu:1", "-o", "/dev/null", "--wrap", "sleep 30")  # no partition named
    assert c.job(held)["priority"] == 0 and c.job(held)["job_state"] == "PENDING"
    wait_until(lambda: c.job(free).get("job_state") == "RUNNING", timeout=30, what="Slurm running it itself")


def test_cli_once_and_print_config(slurm, tmp_path):
    c = slurm
    env = {**os.environ, "DLSHARE_SLURM_PARTITION": c.partition}
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "slurm", "--print-config"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "[slurm]" in out.stdout and f'partition = "{c.partition}"' in out.stdout
    jid = c.sbatch("-p", c.partition, "--gres=gpu:1", "-J", "LM@20", "-o", "/dev/null", "--wrap", "sleep 30")
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "slurm", "--once", "--slurm-conf", str(c.conf),
                          "--journal", str(tmp_path / "j"), "--predictors", "default", "--gpu-slots", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'release': 1" in out.stdout
    wait_until(lambda: c.job(jid).get("job_state") == "RUNNING", timeout=30, what="the job running")
    bad = subprocess.run([sys.executable, "-m", "nodesvc.cli", "slurm", "--once", "--gpu-slots", "0"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gpu_slots must be > 0" in bad.stderr
