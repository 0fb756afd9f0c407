"""``dlshare bench agg``: the shared aggregation service against its baselines, in one run.

1. The C sum kernel against ``np.add(a, b, out=a)``, in bytes touched per second.
2. Push-reduce-pull of a 64 MiB fp32 tensor for N = 2 and 4 worker processes through
   one server process, against ``torch.distributed`` gloo ``all_reduce`` with the same N.
3. DDP step time of a ~12M-parameter model with the hook against default DDP (2 ranks),
   and the largest parameter difference after the steps.
4. M jobs of 2 workers, each alternating a compute phase (a sleep standing in for GPU
   time) with a push of its gradients, on one shared elastic pool and on M dedicated
   servers: cores reserved, CPU-seconds used and each job's iteration time.

Every server and worker is its own process (multiprocessing, spawn), on loopback.

``--network`` runs bench/agg_network.py instead: hosts as network namespaces with
tc-shaped links, the hook against gloo's ring where the network is the bottleneck.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time
from typing import Any

import numpy as np

from bench import agg_pool, agg_timeline, report
from bench.agg_procs import ServerProc, gather, join_all, spawn
from nodesvc.bus.procs import free_port

MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    opts = {
        "--agg-tensor-mb": dict(type=int, default=64, help="agg: round-trip tensor size in MiB (default 64)"),
        "--agg-jobs": dict(type=int, default=4, help="agg: M jobs for shared vs dedicated (default 4)"),
        "--agg-compute-ms": dict(type=float, default=100.0, help="agg: compute phase per iteration (default 100)"),
        "--agg-push-mb": dict(type=int, default=16, help="agg: gradient MiB pushed per iteration (default 16)"),
        "--agg-pool-jobs": dict(default="8,16", help="agg: job counts of the many-job pool part (default 8,16)"),
        "--agg-pool-push-mb": dict(type=float, default=2.0,
                                   help="agg: many-job part, gradient MiB per iteration per job (default 2)"),
        "--agg-pool-compute-ms": dict(type=float, default=200.0,
                                      help="agg: many-job part, compute phase per iteration (default 200)"),
    }
    for flag, kw in opts.items():
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)
    from bench import agg_network

    agg_network.add_arguments(parser, seen)


# --- helpers run in child processes (module level so that spawn can import them) ------------------


def _rt_worker(rank: int, world: int, addr: str, nbytes: int, reps: int, q) -> None:
    from aggregator import Client

    x = np.ones(nbytes // 4, np.float32)
    with Client([addr], f"rt{world}", rank, world) as c:
        for _ in range(2):
            c.allreduce(x, op="sum")
        t0 = time.perf_counter()
        for _ in range(reps):
            c.allreduce(x, op="sum")
        q.put((rank, (time.perf_counter() - t0) / reps))


def _gloo_worker(rank: int, world: int, init: str, nbytes: int, reps: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = torch.ones(nbytes // 4)
    for _ in range(2):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    q.put((rank, (time.perf_counter() - t0) / reps))
    dist.destroy_process_group()


def _ddp_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    # 1024*2048 + 2*2048*2048 + 2048*1024 weights (+ biases): 12.6M parameters
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024))


def _ddp_worker(rank: int, world: int, init: str, addr: str, warmup: int, steps: int, q) -> None:
    """Default DDP and DDP with the hook, one step of each in turn (the machine's load drifts alike over
    both); the hook's steps record every bucket's and chunk's stages."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aggregator import Client
    from aggregator.torch import AggState
    from bench.agg_net_worker import _Timing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    variants = {}
    for name in ("default", "hook"):
        model = _ddp_model()
        ddp = DDP(model)
        client = timing = None
        if name == "hook":
            client, timing = Client([addr], "ddp-bench", rank, world, trace=True), _Timing()
            ddp.register_comm_hook(AggState(client), timing.hook)
        variants[name] = {"model": model, "ddp": ddp, "client": client, "timing": timing,
                          "opt": torch.optim.SGD(ddp.parameters(), lr=0.01),
                          "gen": torch.Generator().manual_seed(10 + rank), "times": [], "marks": [], "cpu": []}
    for i in range(warmup + steps):
        for name, v in variants.items():
            x = torch.randn(32, 1024, generator=v["gen"])
            y = torch.randn(32, 1024, generator=v["gen"])
            dist.barrier()
            t0 = time.perf_counter()
            c0 = time.process_time()  # every thread of this rank: gloo's, the client's
            start = time.time()
            v["opt"].zero_grad()
            loss = ((v["ddp"](x) - y) ** 2).mean()
            t_fwd = time.time()
            loss.backward()
            t_bwd = time.time()
            v["opt"].step()
            v["marks"].append([start, t_fwd, t_bwd, time.time()])
            if i >= warmup:
                v["times"].append(time.perf_counter() - t0)
                v["cpu"].append(time.process_time() - c0)
    hook = variants["hook"]
    trace = {"marks": hook["marks"], "buckets": hook["timing"].buckets, "stages": hook["client"].stage_records(),
             "default_marks": variants["default"]["marks"]}
    hook["client"].close()
    diff = max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(variants["default"]["model"].parameters(), hook["model"].parameters()))
    trace["cpu_s"] = {name: float(np.median(v["cpu"])) for name, v in variants.items()}
    q.put((rank, float(np.median(variants["default"]["times"])), float(np.median(hook["times"])), diff, trace))
    dist.destroy_process_group()


def _job_worker(job: int, rank: int, addr: str, nbytes: int, compute_s: float, iters: int, offset_s: float,
                q) -> None:
    from aggregator import Client

    x = np.ones(nbytes // 4, np.float32)
    times = []
    with Client([addr], f"job{job}", rank, 2) as c:
        c.allreduce(x)  # connect and warm up
        time.sleep(offset_s)
        for _ in range(iters):
            t0 = time.perf_counter()
            time.sleep(compute_s)  # stands in for the GPU's forward and backward
            c.allreduce(x)
            times.append(time.perf_counter() - t0)
    q.put((job, rank, times))


# --- parts ---------------------------------------------------------------------------------------------


def _gbps_pair(fa, fb, touched: int, reps: int) -> tuple[float, float]:
    """Best-of-``reps`` GB/s of two functions, interleaved so that machine noise hits both alike."""
    fa()
    fb()
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((fa, fb)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return touched / best[0] / 1e9, touched / best[1] / 1e9


def bench_kernel(nbytes: int, reps: int) -> dict[str, float]:
    from aggregator import kernel
    from aggregator.protocol import DType

    n = nbytes // 4
    a = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    b = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    out: dict[str, float] = {}
    # bytes touched: read dst, read src, write dst
    out["kernel_gbps"], out["numpy_add_gbps"] = _gbps_pair(
        lambda: kernel.add_(DType.F32, a, b), lambda: np.add(a, b, out=a), 3 * nbytes, reps)
    h1, h2 = a[: n // 2].astype(np.float16), b[: n // 2].astype(np.float16)
    out["kernel_f16_gbps"], out["numpy_add_f16_gbps"] = _gbps_pair(
        lambda: kernel.add_(DType.F16, h1, h2), lambda: np.add(h1, h2, out=h1), 3 * h1.nbytes, max(2, reps // 4))
    w = [np.ones(n // 4, np.float32) for _ in range(4)]
    # the server's reduction: four ranks summed in one pass and divided (reads 4, writes 1)
    out["kernel_sum4_gbps"], _ = _gbps_pair(lambda: kernel.reduce_sum(DType.F32, w[0], w, 4.0), lambda: None,
                                            5 * w[0].nbytes, reps)
    return out


def bench_roundtrip(ctx, world: int, nbytes: int, reps: int) -> tuple[float, float]:
    srv = ServerProc(ctx, server_id=f"rt{world}", max_cores=os.cpu_count() or 2)
    try:
        q = ctx.Queue()
        ps = spawn(ctx, _rt_worker, [(r, world, srv.addr, nbytes, reps, q) for r in range(world)])
        ours = max(t for _, t in gather(q, world, ps))
        join_all(ps)
    finally:
        srv.stop()
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    ps = spawn(ctx, _gloo_worker, [(r, world, init, nbytes, reps, q) for r in range(world)])
    gloo = max(t for _, t in gather(q, world, ps))
    join_all(ps)
    return ours * 1e3, gloo * 1e3


def bench_ddp(ctx, warmup: int, steps: int) -> dict[str, Any]:
    """Default DDP against DDP with the hook, 2 ranks, alternating steps; the hook's stages as well, and
    the CPU a step of each on the whole machine (both ranks' median step; for the hook, the server's
    mean per hook step added, as the server works in no other step)."""
    srv = ServerProc(ctx, server_id="ddp", max_cores=os.cpu_count() or 2, trace=True)
    try:
        q = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        srv_cpu0 = srv.cpu_s()
        ps = spawn(ctx, _ddp_worker, [(r, 2, init, srv.addr, warmup, steps, q) for r in range(2)])
        res = sorted(gather(q, 2, ps, timeout=600), key=lambda r: r[0])
        srv_cpu = srv.cpu_s() - srv_cpu0  # the server works only in the hook's steps
        join_all(ps)
        server_trace = {"s": {"units": srv.stages()}}
    finally:
        srv.stop()
    traces = {f"w{r[0]}": {"hook": r[4]} for r in res}
    b = agg_timeline.breakdown(traces["w0"]["hook"], warmup, list(server_trace.values()), "ddp-bench")
    dm = traces["w0"]["hook"]["default_marks"][warmup:]
    bd = {"step": round(float(np.median([m[3] - m[0] for m in dm])) * 1e3, 1),
          "forward": round(float(np.median([m[1] - m[0] for m in dm])) * 1e3, 1)}
    mr = agg_timeline.median_round(traces["w0"]["hook"], warmup)
    step = agg_timeline.one_step(traces, list(traces), "hook", mr, server_trace, "ddp-bench") if mr is not None else None
    return {
        "ddp_step_ms_hook": max(r[2] for r in res) * 1e3,
        "ddp_step_ms_default": max(r[1] for r in res) * 1e3,
        "ddp_max_abs_diff": max(r[3] for r in res),
        # CPU a step on the whole machine: both ranks (median step), and for the hook the server's mean
        "ddp_cpu_ms_default": round(sum(r[4]["cpu_s"]["default"] for r in res) * 1e3, 1),
        "ddp_cpu_ms_hook": round((sum(r[4]["cpu_s"]["hook"] for r in res) + srv_cpu / (warmup + steps)) * 1e3, 1),
        "ddp_server_cpu_ms": round(srv_cpu / (warmup + steps) * 1e3, 1),
        "ddp_stages": {"hook": b, "default": bd},
        "ddp_step": step,
    }


def _run_jobs(ctx, servers: list[ServerProc], jobs: int, nbytes: int, compute_s: float, iters: int,
              seed: int) -> tuple[dict[int, float], float, float, float]:
    """Run M jobs; returns (mean iteration s per job, wall s, server CPU s, pool core-seconds held)."""
    rng = random.Random(seed)
    offsets = [rng.uniform(0, compute_s) for _ in range(jobs)]
    q = ctx.Queue()
    args = [(j, r, servers[j % len(servers)].addr, nbytes, compute_s, iters, offsets[j], q)
            for j in range(jobs) for r in range(2)]
    cpu0 = [s.cpu_s() for s in servers]
    st0 = [s.stats() for s in servers]
    t0 = time.perf_counter()
    ps = spawn(ctx, _job_worker, args)
    res = gather(q, len(args), ps, timeout=600)
    wall = time.perf_counter() - t0
    st1 = [s.stats() for s in servers]
    cpu = sum(s.cpu_s() - c for s, c in zip(servers, cpu0))
    join_all(ps)
    # pool core-seconds held over the servers' own clock, per server, summed: cores held on average
    held = sum((b["pool"]["held_core_seconds"] - a["pool"]["held_core_seconds"])
               / max(1e-9, b["uptime_s"] - a["uptime_s"]) for a, b in zip(st0, st1)) * wall
    per_job: dict[int, list[float]] = {}
    for j, _, times in res:
        per_job.setdefault(j, []).extend(times[1:])  # the first iteration carries the start offset
    return {j: float(np.mean(v)) for j, v in sorted(per_job.items())}, wall, cpu, held


def bench_shared(ctx, jobs: int, nbytes: int, compute_s: float, iters: int, repeats: int) -> dict[str, Any]:
    """Dedicated and shared runs, alternated ``repeats`` times (the machine is shared and noisy);
    per-job iteration times are medians over the repeats, cores and CPU-seconds are means."""
    # Dedicated: one server per job with a one-thread pool, the smallest pool size there is; one
    # thread sums a 16 MiB push in a few ms, far inside the 100 ms compute phase, so the job alone
    # sees no slowdown from it.
    dedicated_threads = 1
    ded_iters: dict[int, list[float]] = {}
    sh_iters: dict[int, list[float]] = {}
    ded_cpu, sh_cpu, sh_cores = [], [], []
    for rep in range(repeats):
        ded = [ServerProc(ctx, server_id=f"ded{j}", min_cores=dedicated_threads, max_cores=dedicated_threads)
               for j in range(jobs)]
        try:
            it, wall, cpu, _ = _run_jobs(ctx, ded, jobs, nbytes, compute_s, iters, seed=rep)
        finally:
            for s in ded:
                s.stop()
        ded_cpu.append(cpu)
        for j, v in it.items():
            ded_iters.setdefault(j, []).append(v)
        shared = ServerProc(ctx, server_id="shared", min_cores=1, max_cores=jobs, shrink_after_s=0.5)
        try:
            it, wall, cpu, held = _run_jobs(ctx, [shared], jobs, nbytes, compute_s, iters, seed=rep)
        finally:
            shared.stop()
        sh_cpu.append(cpu)
        sh_cores.append(held / wall)
        for j, v in it.items():
            sh_iters.setdefault(j, []).append(v)
    ded_iter = {j: float(np.median(v)) for j, v in ded_iters.items()}
    sh_iter = {j: float(np.median(v)) for j, v in sh_iters.items()}
    slow = {j: sh_iter[j] / ded_iter[j] for j in sh_iter}
    return {
        "shared_cores_avg": round(float(np.mean(sh_cores)), 6),  # float noise of the integral beyond this
        "dedicated_cores": float(jobs * dedicated_threads),
        "shared_cpu_s": float(np.mean(sh_cpu)),
        "dedicated_cpu_s": float(np.mean(ded_cpu)),
        "max_job_slowdown": max(slow.values()),
        "job_iter_ms_shared": {str(j): v * 1e3 for j, v in sh_iter.items()},
        "job_iter_ms_dedicated": {str(j): v * 1e3 for j, v in ded_iter.items()},
    }


# --- entry ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "network", False):
        from bench import agg_network

        return agg_network.run(args)
    quick = bool(getattr(args, "quick", False))
    tensor = getattr(args, "agg_tensor_mb", 64) * MiB
    jobs = getattr(args, "agg_jobs", 4)
    compute_s = getattr(args, "agg_compute_ms", 100.0) / 1e3
    push = getattr(args, "agg_push_mb", 16) * MiB
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    metrics: dict[str, Any] = {}
    print("agg: kernel vs numpy ...", flush=True)
    metrics.update(bench_kernel(tensor, 10 if quick else 30))
    for world in (2, 4):
        print(f"agg: round trip vs gloo, N={world} ...", flush=True)
        ours, gloo = bench_roundtrip(ctx, world, tensor, 3 if quick else 10)
        metrics[f"roundtrip_ms_n{world}"], metrics[f"gloo_ms_n{world}"] = ours, gloo
    print("agg: DDP step time, hook vs default ...", flush=True)
    ddp = bench_ddp(ctx, 1 if quick else 3, 3 if quick else 10)
    ddp_stages, ddp_step = ddp.pop("ddp_stages"), ddp.pop("ddp_step")
    metrics.update(ddp)
    print(f"agg: {jobs} jobs, shared elastic pool vs dedicated servers ...", flush=True)
    shared = bench_shared(ctx, jobs, push, compute_s, 15 if quick else 40, 2 if quick else 3)
    per_job = {k: shared.pop(k) for k in ("job_iter_ms_shared", "job_iter_ms_dedicated")}
    metrics.update(shared)
    pools: dict[int, dict[str, Any]] = {}
    for m in [int(x) for x in str(getattr(args, "agg_pool_jobs", "8,16")).split(",") if x]:
        print(f"agg: {m} jobs arriving and leaving, shared pool vs a dedicated server each ...", flush=True)
        pools[m] = agg_pool.bench_pool(ctx, m, int(getattr(args, "agg_pool_push_mb", 2.0) * MiB),
                                       getattr(args, "agg_pool_compute_ms", 200.0) / 1e3, 15 if quick else 30,
                                       0.25, 2 if quick else 3)
        metrics.update({k: v for k, v in pools[m].items() if not k.endswith(("_jobs", "_series"))})
    m = metrics
    checks = [
        ("kernel_gbps >= 0.8 x numpy_add_gbps", m["kernel_gbps"], ">=", 0.8 * m["numpy_add_gbps"]),
        ("roundtrip_ms_n2 <= 1.0 x gloo_ms_n2", m["roundtrip_ms_n2"], "<=", m["gloo_ms_n2"]),
        ("roundtrip_ms_n4 <= 1.0 x gloo_ms_n4", m["roundtrip_ms_n4"], "<=", m["gloo_ms_n4"]),
        ("ddp_step_ms_hook <= 1.10 x ddp_step_ms_default", m["ddp_step_ms_hook"], "<=",
         1.10 * m["ddp_step_ms_default"]),
        ("ddp_max_abs_diff == 0 (2 ranks)", m["ddp_max_abs_diff"], "==", 0.0),
        ("shared_cores_avg <= 0.25 x dedicated_cores", m["shared_cores_avg"], "<=", 0.25 * m["dedicated_cores"]),
        ("max_job_slowdown <= 1.05", m["max_job_slowdown"], "<=", 1.05),
        ("pool16_max_job_slowdown <= 1.05", m.get("pool16_max_job_slowdown"), "<=", 1.05),
        ("pool16_cpu_s_vs_dedicated <= 0.5", m.get("pool16_cpu_s_vs_dedicated"), "<=", 0.5),
        ("pool16_core_s_vs_dedicated (report)", m.get("pool16_core_s_vs_dedicated"), "<=", None),
    ]
    targets = report.target_rows(checks)
    ratios = {
        "kernel / numpy": m["kernel_gbps"] / m["numpy_add_gbps"],
        "roundtrip / gloo, N=2": m["roundtrip_ms_n2"] / m["gloo_ms_n2"],
        "roundtrip / gloo, N=4": m["roundtrip_ms_n4"] / m["gloo_ms_n4"],
        "DDP hook / default": m["ddp_step_ms_hook"] / m["ddp_step_ms_default"],
        "shared / dedicated cores": m["shared_cores_avg"] / m["dedicated_cores"],
        "shared / dedicated CPU-s": m["shared_cpu_s"] / max(1e-9, m["dedicated_cpu_s"]),
    }
    metrics["elapsed_s"] = time.perf_counter() - t_start
    rows = [{"metric": k, "value": v} for k, v in metrics.items() if not isinstance(v, dict)]
    print(report.markdown_table(rows, ["metric", "value"]))
    print(report.markdown_table([{"ratio": k, "value": v} for k, v in ratios.items()], ["ratio", "value"]))
    jrows = [{"job": j, "iter_ms_dedicated": per_job["job_iter_ms_dedicated"][j],
              "iter_ms_shared": per_job["job_iter_ms_shared"][j],
              "slowdown": per_job["job_iter_ms_shared"][j] / per_job["job_iter_ms_dedicated"][j]}
             for j in per_job["job_iter_ms_shared"]]
    print(report.markdown_table(jrows, ["job", "iter_ms_dedicated", "iter_ms_shared", "slowdown"]))
    print(report.markdown_table(targets, ["target", "value", "op", "bound", "met"]))
    print(report.markdown_table([{"variant": k, **v} for k, v in ddp_stages.items()],
                                ["variant", "step", "forward", "before_comm", "comm", "after_comm", "buckets_handed_over",
                                 "last_push_done", "server_last_arrival", "server_last_sum", "last_result_in"]))
    plot = _plot(ratios, jrows, pools, getattr(args, "json", None))
    ddp_plot = None
    if ddp_step:
        ddp_plot = agg_timeline.plot({"ddp_hook_loopback": ddp_step}, {},
                                     report.out_dir(getattr(args, "json", None)) / "agg_ddp_timeline.png")
    return report.envelope("agg", metrics, ratios=ratios, jobs=jrows, targets=targets, plot=str(plot),
                           ddp_stages=ddp_stages, ddp_step=ddp_step, ddp_plot=str(ddp_plot),
                           pools={str(m): {k: v for k, v in r.items() if k.endswith(("_jobs", "_series"))}
                                  for m, r in pools.items()},
                           params={"quick": quick, "tensor_bytes": tensor, "jobs": jobs, "compute_s": compute_s,
                                   "push_bytes": push})


def _plot(ratios: dict[str, float], jrows: list[dict], pools: dict[int, dict[str, Any]], json_path: str | None):
    plt = report.pyplot()
    fig, axes = plt.subplots(2 if pools else 1, 2, figsize=(12, 9 if pools else 4.5), squeeze=False)
    (ax1, ax2) = axes[0]
    if pools:
        agg_pool.plot(pools, axes[1][0], axes[1][1])
    names = list(ratios)
    ax1.barh(names, [ratios[n] for n in names], color="tab:blue")
    ax1.axvline(1.0, color="grey", lw=1)
    ax1.set_xlabel("ratio (ours / baseline)")
    ax1.set_title("agg: ratios against baselines")
    x = np.arange(len(jrows))
    ax2.bar(x - 0.2, [r["iter_ms_dedicated"] for r in jrows], 0.4, label="dedicated servers")
    ax2.bar(x + 0.2, [r["iter_ms_shared"] for r in jrows], 0.4, label="shared elastic pool")
    ax2.set_xticks(x, [f"job {r['job']}" for r in jrows])
    ax2.set_ylabel("iteration time (ms)")
    ax2.legend()
    ax2.set_title("per-job iteration time")
    fig.tight_layout()
    path = report.out_dir(json_path) / "agg.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
