"""dlshare schedules a real Slurm partition: placement, CPU/memory, co-location, preemption, reasons.

A real slurmctld and three slurmd (conftest.py); the shell runs in this process and the test steps it.
Each job records where Slurm ran it and what it was given (node, the GPUs the TaskProlog bound from
dlshare's AdminComment, CPUs, memory), so the checks compare the core's decisions with what Slurm
really did.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from scheduler.model import JobState
from tests.scheduler.slurm.conftest import drive, make_shell

pytestmark = pytest.mark.slow

MiB = 1 << 20

LAS_FAST = """name = "las-fast"
[order]
plugin = "las"
args = { quantum_s = 2.0 }
[placement]
share = "never"
[[score]]
plugin = "consolidate"
[allocate]
plugin = "proportional"
"""

PACK = """name = "pack"
[order]
plugin = "fifo"
[placement]
share = "when_full"
max_share = 2
[[score]]
plugin = "consolidate"
[allocate]
plugin = "synergy"
"""


def submit(c, tmp_path, *args, sleep=300, name=None):
    """A job that notes where it runs and with what (one line per start), then sleeps."""
    log = tmp_path / "starts"
    script = (f'echo "$SLURM_JOB_ID $SLURMD_NODENAME ${{CUDA_VISIBLE_DEVICES:-none}} $SLURM_CPUS_ON_NODE '
              f'$SLURM_MEM_PER_NODE" >> {log}; sleep {sleep}')
    extra = ["-J", name] if name else []
    return c.sbatch("-p", c.partition, "-o", "/dev/null", *extra, *args, "--wrap", script)


def starts(tmp_path) -> dict[str, list[list[str]]]:
    out: dict[str, list[list[str]]] = {}
    p = tmp_path / "starts"
    for line in (p.read_text().splitlines() if p.exists() else []):
        f = line.split()
        out.setdefault(f[0], []).append(f[1:])
    return out


def squeue(c, jid):
    return c.job(jid)


def time_limit(c, jid) -> int:
    """The job's time limit in minutes as Slurm shows it now."""
    v = c.job(jid)["time_limit"]
    return int(v["number"] if isinstance(v, dict) else v)


def test_placement_cpu_and_memory_by_sensitivity(slurm, tmp_path):
    c = slurm
    sh = make_shell(c, tmp_path, "synergy")
    a = submit(c, tmp_path, "--gres=gpu:1", "--comment", "model=res18")
    b = submit(c, tmp_path, "--gres=gpu:1", "--comment", "model=lstm batch_size=128")
    d = submit(c, tmp_path, "--gres=gpu:2", name="LM@20")
    got = drive(sh, lambda: (lambda s: s if len(s) == 3 else None)(starts(tmp_path)), what="three jobs running")
    given = {}
    for jid in (a, b, d):
        rec = sh.core.records[jid]
        (shard,) = rec.shards
        alloc = rec.allocation[shard.node]
        ((node, gpus, cpus, mem),) = got[jid]
        assert node == shard.node, (jid, got, rec.shards)
        assert gpus == ",".join(map(str, shard.gpus))  # bound by the TaskProlog from dlshare's AdminComment
        assert int(cpus) == math.floor(alloc.cpus + 1e-6), (jid, got, alloc, sh.stats.to_dict())
        assert int(mem) == alloc.memory_bytes // MiB, (jid, got, alloc)
        given[jid] = (int(cpus), int(mem))
    assert sh.core.records[d].job.model == "LM" and sh.core.records[d].job.gpus == 2
    assert sh.core.records[b].job.batch_size == 128
    # Synergy's tables: lstm runs as fast on 1 CPU, res18 gains from more, so res18 gets what lstm needs
    # not; the unprofiled LM keeps the GPU-proportional share (3 CPUs and 64000 MiB a GPU here)
    assert given[d] == (6, 2 * 64000), given
    assert given[b][0] < 3 < given[a][0], given
    assert sh.stats.actions.get("release") == 3 and sh.stats.latency_s
    sh.close()


def test_colocation_in_declared_gpu_slots(slurm, tmp_path):
    c = slurm
    sh = make_shell(c, tmp_path, PACK)
    ids = [submit(c, tmp_path, "--gres=gpu:1", "--time=10", name="ResNet-18@32") for _ in range(14)]
    got = drive(sh, lambda: (lambda s: s if len(s) == 14 else None)(starts(tmp_path)), timeout=90,
                what="14 jobs on 12 GPUs")
    shared = [j for j in ids if sh.core.records[j].shards and
              len(sh.core.nodes[sh.core.records[j].shards[0].node].residents[sh.core.records[j].shards[0].gpus[0]]) > 1]
    assert len(shared) == 4  # two GPUs hold two jobs each
    # A job slowed by a partner is not killed at the --time it asked for running alone: both partners'
    # limits (the resident's and the newcomer's) grow by the predicted slowdown, at least 2x; no other's does.
    limits = drive(sh, lambda: (lambda m: m if all(m[j] >= 20 for j in shared) else None)(
        {j: time_limit(c, j) for j in ids}), timeout=60, what="shared jobs' time limits extended")
    assert all(limits[j] <= 40 for j in shared)
    assert {limits[j] for j in ids if j not in shared} == {10}
    by_gpu = {}
    for j in shared:
        ((node, gpus, _, _),) = got[j]
        by_gpu.setdefault((node, gpus), []).append(j)
    assert sorted(len(v) for v in by_gpu.values()) == [2, 2]  # partners really run on the same node and GPU
    for j in ids:
        assert c.job(j)["job_state"] == "RUNNING"
    sh.close()


def test_preemption_requeues_held_and_places_again(slurm, tmp_path):
    c = slurm
    sh = make_shell(c, tmp_path, LAS_FAST)
    first = [submit(c, tmp_path, "--gres=gpu:4", name="LM@20") for _ in range(3)]
    drive(sh, lambda: len(starts(tmp_path)) == 3, what="the cluster full")
    late = submit(c, tmp_path, "--gres=gpu:4", name="LM@20")
    drive(sh, lambda: late in starts(tmp_path), timeout=60, what="the late job running after a preemption")
    victims = [j for j in first if c.job(j)["restart_cnt"] >= 1]
    assert victims, "no job was requeued"
    assert sh.stats.preempts >= 1 and sh.stats.actions.get("requeue", 0) >= 1
    v = victims[0]
    # held while it waits, then placed again when LAS's rotation comes back to it
    drive(sh, lambda: len(starts(tmp_path).get(v, [])) >= 2, timeout=60, what="the victim running again")
    assert c.job(v)["job_state"] == "RUNNING"
    sh.close()


def test_unplaceable_and_bad_jobs_stay_held_with_a_reason(slurm, tmp_path):
    c = slurm
    sh = make_shell(c, tmp_path, "fifo", status_s=0.5)
    big = submit(c, tmp_path, "--gres=gpu:8", "-N", "2", "--comment", "model=LM bs=20")  # 16 > 12 GPUs
    bad = submit(c, tmp_path, "--gres=gpu:1", "--comment", "model=LM bs=twenty")
    ok = submit(c, tmp_path, "--gres=gpu:4", name="LM@20")
    drive(sh, lambda: ok in starts(tmp_path) and "dlshare:" in c.job(bad)["comment"]
          and "dlshare:" in c.job(big)["comment"], what="reasons on the held jobs")
    assert c.job(big)["priority"] == 0 and "cannot run: needs 16 GPUs, the cluster has 12" in c.job(big)["comment"]
    assert c.job(bad)["priority"] == 0 and "bad job fields: bs='twenty'" in c.job(bad)["comment"]
    out = c.run("squeue", "-h", "-j", bad, "-o", "%k").stdout  # visible with plain squeue
    assert "not scheduled" in out
    c.run("scontrol", "update", f"JobId={bad}", "Comment=model=LM bs=20")  # the user fixes it
    drive(sh, lambda: bad in starts(tmp_path), what="the fixed job running")
    assert sh.core.records[bad].job.batch_size == 20
    assert sh.core.records[big].job.state is JobState.FAILED
    sh.close()


def test_telemetry_of_dlshare_node_beside_slurmd_reaches_the_core(slurm, tmp_path, mosquitto):
    import subprocess
    import sys

    from nodesvc.bus.procs import stop_proc
    from scheduler.slurm.telemetry import TelemetryFeed

    node = subprocess.Popen([sys.executable, "-m", "nodesvc.cli", "node", "--broker", mosquitto.url, "--node-id", "n2",
                             "--interval", "0.5", "--no-enforce", "--fake-gpus", "4", "--metrics-listen", "127.0.0.1:-1"],
                            stdout=open(tmp_path / "node.log", "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "DLSHARE_NODE_STATE_DIR": str(tmp_path / "state-n2")})
    feed = TelemetryFeed(mosquitto.url)
    feed.start()
    sh = make_shell(slurm, tmp_path, "fifo", telemetry=feed, telemetry_s=0.5)
    try:
        drive(sh, lambda: sh.core.nodes.get("n2") is not None and sh.core.nodes["n2"].cpu_percent is not None,
              timeout=60, what="n2's telemetry in the core")
        ns = sh.core.nodes["n2"]
        assert len(ns.gpu_util) == 4 and ns.memory_available_bytes > 0
        assert sh.core.nodes["n1"].cpu_percent is None  # no daemon beside n1's slurmd
        # a malformed telemetry payload is dropped with a log line; the shell goes on
        subprocess.run(["mosquitto_pub", "-p", str(mosquitto.port), "-t", "dlshare/v1/node/n1/telemetry",
                        "-m", "{not json"], check=True, timeout=10)
        drive(sh, lambda: feed.rejected >= 1, timeout=20, what="the bad payload rejected")
        assert sh.core.nodes["n1"].cpu_percent is None
    finally:
        sh.close()
        stop_proc(node)


OWNER_QUOTAS = """name = "fifo-quota"
[order]
plugin = "fifo"
[placement]
share = "never"
backfill = true
[[score]]
plugin = "consolidate"
[allocate]
plugin = "proportional"
[quota.default_user]
gpus = 4
[quota.accounts.vision]
gpus = 2
"""


def test_slurm_users_and_accounts_get_their_own_quotas(slurm, tmp_path):
    """Jobs of two local users (root, and nobody through sbatch --uid), one account: each owner's limit
    holds only its own jobs back, on a cluster with room to spare (7 of 12 GPUs in use)."""
    c = slurm
    sh = make_shell(c, tmp_path, OWNER_QUOTAS, status_s=0.5)

    def sub(*args):
        return c.sbatch("-p", c.partition, "-o", "/dev/null", "-J", "LM@20", *args, "--wrap", "sleep 300")

    root = [sub("--gres=gpu:4"), sub("--gres=gpu:4")]  # root: 8 GPUs asked, 4 allowed
    vision = [sub("--uid", "nobody", "--account", "vision", "--gres=gpu:1") for _ in range(3)]  # vision: 2 allowed
    free = sub("--uid", "nobody", "--gres=gpu:1")  # nobody's own job, no account: 3 of nobody's 4 GPUs

    def settled():
        jobs = {j: c.job(j) for j in (*root, *vision, free)}
        run = {j for j, d in jobs.items() if d.get("job_state") == "RUNNING"}
        waits = {j for j, d in jobs.items() if "(quota)" in d.get("comment", "")}
        return (run, waits, jobs) if len(run) == 4 and len(waits) == 2 else None

    run, waits, jobs = drive(sh, settled, timeout=60, what="4 jobs running, 2 held by their owner's quota")
    assert sh.core.records[root[0]].job.user == "root" and sh.core.records[root[0]].job.account == ""
    assert {(sh.core.records[j].job.user, sh.core.records[j].job.account) for j in vision} == {("nobody", "vision")}
    assert (sh.core.records[free].job.user, sh.core.records[free].job.account) == ("nobody", "")
    assert free in run and len(run & set(root)) == 1 and len(run & set(vision)) == 2 and not run & waits
    (r_wait,) = set(root) - run
    assert jobs[r_wait]["priority"] == 0 and "user 'root' holds 4 of its 4 GPUs (quota)" in jobs[r_wait]["comment"]
    (v_wait,) = set(vision) - run
    assert jobs[v_wait]["priority"] == 0 and "account 'vision' holds 2 of its 2 GPUs (quota)" in jobs[v_wait]["comment"]
    assert jobs[v_wait]["user_name"] == "nobody"  # really submitted as another user
    # an owner's next job starts when its own running one ends
    c.run("scancel", next(iter(run & set(root))))
    drive(sh, lambda: c.job(r_wait).get("job_state") == "RUNNING", timeout=60, what="root's second job running")
    assert c.job(v_wait)["job_state"] == "PENDING"
    sh.close()


FAIR = OWNER_QUOTAS.split("[quota")[0].replace("fifo-quota", "fifo-fair") + """[fairshare]
enabled = true
half_life_s = 0
"""


@pytest.mark.parametrize("fair", [True, False])
def test_slurm_fair_share_starts_the_other_users_job_first(slurm, tmp_path, fair):
    """root fills the cluster, then queues one more job; nobody queues one a second later.  When a GPU
    node frees up, FIFO starts root's (it came first); fair share starts nobody's (no usage yet)."""
    from nodesvc.bus.procs import wait_until

    c = slurm
    sh = make_shell(c, tmp_path, FAIR if fair else OWNER_QUOTAS.split("[quota")[0])

    def sub(*args):
        return c.sbatch("-p", c.partition, "-o", "/dev/null", "-J", "LM@20", "--gres=gpu:4", *args,
                        "--wrap", "sleep 300")

    full = [sub() for _ in range(3)]
    drive(sh, lambda: all(c.job(j).get("job_state") == "RUNNING" for j in full), what="root's jobs filling the cluster")
    late_root = sub()
    t0 = c.job(late_root)["submit_time"]
    wait_until(lambda: int(time.time()) > t0, 5, "the next second")  # FIFO would put root's job first
    other = sub("--uid", "nobody")
    assert c.job(other)["submit_time"] > t0
    drive(sh, lambda: {late_root, other} <= set(sh.core.records), what="both waiting in the core")
    c.run("scancel", full[0])
    first = drive(sh, lambda: next((j for j in (late_root, other) if c.job(j).get("job_state") == "RUNNING"), None),
                  what="one of the waiting jobs running")
    assert first == (other if fair else late_root)
    assert (sh.core.records[other].job.user, sh.core.records[late_root].job.user) == ("nobody", "root")
    sh.close()
