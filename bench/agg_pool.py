"""``dlshare bench agg``, many jobs: one shared elastic pool against one dedicated server per job.

M jobs (8 and 16) of 2 workers each arrive one after another, every ``stagger`` seconds, run
the same number of iterations (a compute phase, a sleep standing in for GPU time, then an
all-reduce of their gradients) and leave, so the number of jobs in flight rises, holds and
falls.  They run twice, alternated: each job on a server of its own (a one-thread pool, the
smallest a server can be) and all jobs on one shared server whose pool grows and shrinks with
the load.  Per job: the median iteration time in each setting and their ratio (the slowdown).
For the servers: the CPU-seconds their processes used (what the OS measured), the core-seconds
they held (a dedicated server holds its core for its job's lifetime; the shared pool holds
its size, integrated over time), and the shared pool's size over time next to the number of
jobs in flight.

Every job is its own process (its two ranks are threads in it), every server its own process,
all on loopback.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.agg_procs import join_all, ServerProc, spawn


def _pool_job(job: int, addrs: list[str], nbytes: int, compute_s: float, iters: int, start_at: float, q) -> None:
    import threading

    from aggregator import Client

    def rank(r: int, out: list) -> None:
        x = np.ones(nbytes // 4, np.float32)
        times = []
        with Client(addrs, f"pool{job}", r, 2) as c:
            c.allreduce(x)  # connect (before the job's arrival time: joining is not part of an iteration)
            time.sleep(max(0.0, start_at - time.time()))
            t_in = time.time()
            for _ in range(iters):
                t0 = time.perf_counter()
                time.sleep(compute_s)  # stands in for the GPU's forward and backward
                c.allreduce(x)
                times.append(time.perf_counter() - t0)
            out.append((r, t_in, time.time(), times))

    out: list = []
    ts = [threading.Thread(target=rank, args=(r, out)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((job, min(o[1] for o in out), max(o[2] for o in out), [o[3] for o in sorted(out)]))


def _run(ctx, servers: list[ServerProc], jobs: int, nbytes: int, compute_s: float, iters: int,
         stagger_s: float, sample_pool: bool) -> dict[str, Any]:
    q = ctx.Queue()
    t_first = time.time() + 3.0 + 0.15 * jobs  # every job process has started and connected by then
    args = [(j, [servers[j % len(servers)].addr], nbytes, compute_s, iters, t_first + j * stagger_s, q)
            for j in range(jobs)]
    cpu0 = [s.cpu_s() for s in servers]
    ps = spawn(ctx, _pool_job, args)
    pool: list[tuple[float, int, int]] = []  # (time, pool size, jobs registered)
    got: list = []
    import queue as _q

    deadline = time.monotonic() + 600
    while len(got) < jobs:
        if sample_pool:
            st = servers[0].stats()
            pool.append((time.time(), st["pool"]["size"], len(st["jobs"])))
        try:
            got.append(q.get(timeout=0.2))
        except _q.Empty:
            dead = [p for p in ps if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"pool bench: job process {dead[0].name if dead else '?'} failed or timed out")
    cpu = sum(s.cpu_s() - c for s, c in zip(servers, cpu0))
    join_all(ps)
    res = {j: (t0, t1, times) for j, t0, t1, times in got}
    iter_s = {j: float(np.median([t for rk in v[2] for t in rk[1:]])) for j, v in res.items()}
    lifetimes = {j: v[1] - v[0] for j, v in res.items()}
    t0, t1 = min(v[0] for v in res.values()), max(v[1] for v in res.values())
    if sample_pool:
        held = _integral([(t, s) for t, s, _ in pool], t0, t1)
    else:
        held = sum(lifetimes.values())  # a dedicated server's core, for its job's lifetime
    return {"iter_s": iter_s, "cpu_s": cpu, "core_s": held, "span": (t0, t1), "pool": pool,
            "jobs_in_flight": [(v[0], v[1]) for v in res.values()]}


def _integral(samples: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Integral of a step function sampled at ``samples`` (time, value) over [t0, t1]."""
    total = 0.0
    for (ta, va), (tb, _) in zip(samples, samples[1:]):
        a, b = max(ta, t0), min(tb, t1)
        if b > a:
            total += va * (b - a)
    return total


def bench_pool(ctx, jobs: int, nbytes: int, compute_s: float, iters: int, stagger_s: float,
               repeats: int) -> dict[str, Any]:
    """Dedicated servers and one shared pool, alternated ``repeats`` times with the same arrivals."""
    ded_iter: dict[int, list[float]] = {}
    sh_iter: dict[int, list[float]] = {}
    ded_cpu, sh_cpu, ded_core, sh_core = [], [], [], []
    series = None
    for _ in range(repeats):
        ded = [ServerProc(ctx, server_id=f"ded{j}", min_cores=1, max_cores=1) for j in range(jobs)]
        try:
            r = _run(ctx, ded, jobs, nbytes, compute_s, iters, stagger_s, False)
        finally:
            for s in ded:
                s.stop()
        ded_cpu.append(r["cpu_s"])
        ded_core.append(r["core_s"])
        for j, v in r["iter_s"].items():
            ded_iter.setdefault(j, []).append(v)
        shared = ServerProc(ctx, server_id="shared", min_cores=1, max_cores=jobs, shrink_after_s=0.5)
        try:
            r = _run(ctx, [shared], jobs, nbytes, compute_s, iters, stagger_s, True)
        finally:
            shared.stop()
        sh_cpu.append(r["cpu_s"])
        sh_core.append(r["core_s"])
        for j, v in r["iter_s"].items():
            sh_iter.setdefault(j, []).append(v)
        t0 = r["span"][0]
        series = {"t": [round(t - t0, 3) for t, _, _ in r["pool"]], "pool_size": [s for _, s, _ in r["pool"]],
                  "jobs_registered": [n for _, _, n in r["pool"]],
                  "jobs_in_flight": [sum(1 for a, b in r["jobs_in_flight"] if a <= t <= b) for t, _, _ in r["pool"]]}
    d = {j: float(np.median(v)) for j, v in ded_iter.items()}
    s = {j: float(np.median(v)) for j, v in sh_iter.items()}
    slow = {j: s[j] / d[j] for j in s}
    p = f"pool{jobs}"
    return {
        f"{p}_max_job_slowdown": round(max(slow.values()), 4),
        f"{p}_median_job_slowdown": round(float(np.median(list(slow.values()))), 4),
        f"{p}_cpu_s_shared": round(float(np.mean(sh_cpu)), 3),
        f"{p}_cpu_s_dedicated": round(float(np.mean(ded_cpu)), 3),
        f"{p}_cpu_s_vs_dedicated": round(float(np.mean(sh_cpu)) / max(1e-9, float(np.mean(ded_cpu))), 4),
        f"{p}_core_s_shared": round(float(np.mean(sh_core)), 3),
        f"{p}_core_s_dedicated": round(float(np.mean(ded_core)), 3),
        f"{p}_core_s_vs_dedicated": round(float(np.mean(sh_core)) / max(1e-9, float(np.mean(ded_core))), 4),
        f"{p}_jobs": {str(j): {"iter_ms_dedicated": round(d[j] * 1e3, 2), "iter_ms_shared": round(s[j] * 1e3, 2),
                               "slowdown": round(slow[j], 4)} for j in sorted(s)},
        f"{p}_series": series,
    }


def plot(results: dict[int, dict[str, Any]], ax_pool, ax_slow) -> None:
    """Pool size over time (and jobs in flight) per job count; per-job slowdowns."""
    for m, r in sorted(results.items()):
        ser = r[f"pool{m}_series"]
        if ser:
            ax_pool.step(ser["t"], ser["pool_size"], where="post", label=f"{m} jobs: shared pool threads")
            ax_pool.plot(ser["t"], ser["jobs_in_flight"], ls=":", label=f"{m} jobs: jobs in flight")
        jobs = r[f"pool{m}_jobs"]
        ax_slow.plot([int(j) for j in jobs], [v["slowdown"] for v in jobs.values()], "o-", label=f"{m} jobs")
    ax_pool.set_xlabel("seconds")
    ax_pool.set_ylabel("threads / jobs")
    ax_pool.set_title("shared pool size as jobs arrive and leave")
    ax_pool.legend(fontsize=7)
    ax_slow.axhline(1.05, color="grey", ls="--", lw=1)
    ax_slow.set_xlabel("job (arrival order)")
    ax_slow.set_ylabel("iteration time, shared / dedicated")
    ax_slow.set_title("per-job slowdown on the shared pool")
    ax_slow.legend(fontsize=7)
