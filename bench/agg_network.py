"""``dlshare bench agg --network``: the aggregation hook against gloo's ring over shaped links.

Every host is a network namespace on one bridge (nodesvc/netns.py); each host's
veth pair is shaped with tbf to the same rate in both directions, so each host
has a NIC of that speed and the bridge is a non-blocking switch.  n = 4 worker
hosts train the same ~25M-parameter, mostly dense model on the same data:

- plain DDP, whose gloo all-reduce is a ring over the workers: each worker
  sends and receives 2(n-1)/n x M a step (M: the gradient bytes), bound
  2(n-1)/n x M / B;
- DDP with the dlshare hook on k = 1, 2, 4 server hosts: each worker sends and
  receives M, each server nM/k, bound max(M, nM/k) / B;
- the hook at k = 4 with fp16 and bf16 on the wire, and with one server
  killed with SIGKILL mid-step (then restarted), whose final parameters must
  equal the fault-free run's;
- two jobs of 4 workers each, every step a compute phase (a sleep standing in
  for GPU time) then the backward's reduction, each on its own ring and then
  both on the same 4 servers, showing when their rounds are on the servers.

Per phase it reports the step time next to its bound, the bytes each host sent
and received per step (link counters), each host's CPU time and the machine's
CPU use, so a reader can check that the links and not the 2 cores were the
bottleneck.  A first phase runs the same steps with no communication (the
compute alone).  Every worker and server records each bucket's and chunk's
stages (aggregator/stages.py): bench/agg_timeline.py splits each step into its
parts and draws one step of each phase with the link rates under it.
Namespaces, qdiscs and processes are torn down even on failure.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.placement import chunk_for_link
from bench import agg_timeline, report
from bench.agg_hosts import Cluster
from nodesvc import netns

GLOO_PORT, STORE_PORT = 29500, 29600
# 500 Mbit/s: measured on the 2-vCPU VM (bench/RESULTS.md), every worker process used about 12% of a
# core and every server about 4% at this rate, so the links and not our CPU bound the steps.
DEFAULT_RATE_MBIT = 500.0


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    opts = {
        "--network": dict(action="store_true", help="agg: the multi-host benchmark over tc-shaped namespaces (root)"),
        "--net-rate-mbit": dict(type=float, default=DEFAULT_RATE_MBIT,
                                help=f"agg --network: link rate in Mbit/s (default {DEFAULT_RATE_MBIT:g})"),
        "--net-compute-ms": dict(type=float, default=None,
                                 help="agg --network: two-job compute phase per step (default: M/B, one gradient's "
                                      "transfer time at the link rate)"),
        "--net-width": dict(type=int, default=4096, help="agg --network: hidden width (4096: 25.2M parameters)"),
        "--net-phases": dict(default="", help="agg --network: run only these phases (comma-separated: ring, hook_k1, "
                                             "hook_k2, hook_k4, hook_k4_fp16, hook_k4_bf16, failover_k4, two_jobs); "
                                             "for development, the targets need them all"),
        "--net-window-chunks": dict(type=int, default=-1, help="agg --network: the hook's push window in chunks "
                                                              "(default: the client's own)"),
        "--net-variants": dict(default="", help="agg --network, development: extra k = 4 phases with other client "
                                               "settings, NAME:WINDOW:CHUNK_KB,... (CHUNK_KB 0: from the link "
                                               "rate), each run twice, interleaved with hook_k4"),
        "--net-chunk-kb": dict(type=int, default=0, help="agg --network: the hook's chunk size in KiB "
                                                        "(default: the client's, from the link rate)"),
    }
    for flag, kw in opts.items():
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


# --- the run ------------------------------------------------------------------------------------------


def _median_ms(xs: list[float]) -> float:
    return float(np.median(xs)) * 1e3


def _phase_row(name: str, res: dict[str, dict], cl: Cluster, workers: list[str], servers: list[str],
               bound_s: float, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """Step time (the slowest worker's median, over ``name`` and the repeats in ``also``), and over
    ``name``'s own steps: bytes per step per host, CPU per host, machine CPU."""
    step = max(_median_ms([t for p in (name, *also) for t in res[w][p]["step_s"]]) for w in workers)
    t0 = max(res[w][name]["window"][0] for w in workers)
    t1 = min(res[w][name]["window"][1] for w in workers)
    n = len(res[workers[0]][name]["step_s"])
    d = cl.sampler.delta(t0, t1)
    span = max(1e-9, t1 - t0)
    wcpu = [res[w][name]["cpu_s"] / max(1e-9, res[w][name]["window"][1] - res[w][name]["window"][0]) for w in workers]
    row = {
        "phase": name, "steps": sum(len(res[workers[0]][p]["step_s"]) for p in (name, *also)),
        "step_ms": round(step, 1), "bound_ms": round(bound_s * 1e3, 1),
        "step_vs_bound": round(step / (bound_s * 1e3), 3) if bound_s else None,
        "worker_sent_mb": round(float(np.mean([d["sent"][w] for w in workers])) / n / 1e6, 1),
        "worker_recv_mb": round(float(np.mean([d["recv"][w] for w in workers])) / n / 1e6, 1),
        "server_recv_mb": round(float(np.mean([d["recv"][s] for s in servers])) / n / 1e6, 1) if servers else 0.0,
        "server_sent_mb": round(float(np.mean([d["sent"][s] for s in servers])) / n / 1e6, 1) if servers else 0.0,
        "worker_cpu_pct": round(100 * float(np.mean(wcpu)), 1),
        # sleeps and wake-ups of a worker's threads per step (voluntary context switches)
        "worker_wakeups": round(float(np.mean([res[w][name].get("wakeups", 0) for w in workers])) / n),
        "server_cpu_pct": round(100 * float(np.mean([d["cpu_s"].get(s, 0.0) for s in servers])) / span, 1)
        if servers else 0.0,
        "machine_cpu_pct": round(100 * d["machine_busy"], 1) if d["machine_busy"] is not None else None,
        "retrans_segs": round(sum(c.get("RetransSegs", 0) for h, c in d["tcp"].items() if h in workers + servers) / n, 1)
        if d["tcp"] else None,
        "tcp": {h: {k: v for k, v in c.items() if v} for h, c in d["tcp"].items() if h in workers + servers},
    }
    row["hosts"] = {h: {"sent_mb_per_step": round(d["sent"][h] / n / 1e6, 2),
                        "recv_mb_per_step": round(d["recv"][h] / n / 1e6, 2),
                        "cpu_pct": round(100 * (res[h][name]["cpu_s"] / span if h in res
                                                else d["cpu_s"].get(h, 0.0) / span), 1)}
                    for h in workers + servers}
    return row


def _overlap(a: list[list[float]], b: list[list[float]]) -> float:
    """Time both jobs had a round in flight, over the time either had one (0: interleaved, 1: together)."""
    def union(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    ua, ub = union([w for w in a if w[1] > w[0]]), union([w for w in b if w[1] > w[0]])
    both = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in ua for s2, e2 in ub)
    either = sum(e - s for s, e in union(ua + ub))
    return both / either if either > 0 else 0.0


ALL_PHASES = ("compute_only", "ring", "hook_k1", "hook_k2", "hook_k4", "hook_k4_fp16", "hook_k4_bf16", "failover_k4", "two_jobs")


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = netns.shaping_available()
    if reason:
        raise SystemExit(f"dlshare bench agg --network: cannot build shaped hosts here: {reason}. It needs root, "
                         "network namespaces, veth pairs and tc tbf (iproute2, util-linux).")
    quick = bool(getattr(args, "quick", False))
    want = [p for p in (getattr(args, "net_phases", "") or "").split(",") if p] or list(ALL_PHASES)
    bad = [p for p in want if p not in ALL_PHASES]
    if bad:
        raise SystemExit(f"dlshare bench agg --network: unknown phase(s) {', '.join(bad)}; "
                         f"known: {', '.join(ALL_PHASES)}")
    if any(p in want for p in ("hook_k4_fp16", "hook_k4_bf16", "failover_k4")) and "hook_k4" not in want:
        want.append("hook_k4")  # their reference
    rate_bit = int(args.net_rate_mbit * 1e6)
    width = args.net_width
    nparams = 2 * 1024 * width + width * width + 2 * width + 1024
    grad = 4 * nparams
    n = 4
    B = rate_bit / 8
    compute_s = (grad / B) if args.net_compute_ms is None else args.net_compute_ms / 1e3
    # Step 0 rebuilds DDP's buckets (and joins the servers); from step 1 on every step is alike.
    warmup, steps = (1, 3) if quick else (2, 8)
    fo_steps = warmup + max(steps, 5)  # the failover run and its fault-free reference
    batch = 8
    chunk = (getattr(args, "net_chunk_kb", 0) or 0) * 1024 or None
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dlshare-aggnet-"))
    prev = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    cl = Cluster(2 * n, 4, rate_bit, tmp)
    ok = False
    say = lambda m: print(f"agg --network: {m}", flush=True)  # noqa: E731
    res: dict[str, dict] = {}
    res2: dict[str, dict] = {}
    rows: list[dict] = []
    jrows: list[dict] = []
    rates: dict[str, dict] = {}
    fo: dict[str, dict] = {}
    used_again = back_at = killed_at = None
    W, S = [f"w{r}" for r in range(n)], cl.servers
    try:
        say(f"{len(cl.net.hosts)} hosts on a bridge, every link shaped to {args.net_rate_mbit:g} Mbit/s each way; "
            f"model {nparams / 1e6:.1f}M parameters ({grad / 1e6:.0f} MB of gradients a step)")
        cl.start()
        srv = [cl.addr(s) for s in cl.servers]
        victim = max(range(4), key=lambda i: srv[i])  # any; the last of the sorted list, as in the tests
        # the hook's clients are told the hosts' link rate, and size their chunks from it
        base = {"width": width, "batch": batch, "warmup": warmup, "world": n, "link_gbit": rate_bit / 1e9}
        if chunk:
            base["chunk_bytes"] = chunk
        if getattr(args, "net_window_chunks", -1) >= 0:
            base["window_chunks"] = args.net_window_chunks
        phases = [
            # the same steps with no communication: what the 4 workers' compute alone takes on this machine
            {"name": "compute_only", "steps": warmup + steps, "no_comm": True},
            {"name": "ring", "steps": warmup + steps},
            {"name": "hook_k1", "steps": warmup + steps, "servers": srv[:1]},
            {"name": "hook_k2", "steps": warmup + steps, "servers": srv[:2]},
            {"name": "hook_k4", "steps": fo_steps, "servers": srv, "keep": True},
            {"name": "hook_k4_fp16", "steps": fo_steps, "servers": srv, "compress": "fp16", "compare_to": "hook_k4"},
            {"name": "hook_k4_bf16", "steps": fo_steps, "servers": srv, "compress": "bf16", "compare_to": "hook_k4"},
            {"name": "failover_k4", "steps": fo_steps, "servers": srv, "compare_to": "hook_k4",
             "kill_pid": cl.procs[cl.servers[victim]].pid, "kill_step": warmup + 1},
            # the ring and k = 4 once more, so that the machine's load drifts alike over both
            {"name": "ring_again", "steps": warmup + steps},
            {"name": "hook_k4_again", "steps": fo_steps, "servers": srv},
        ]
        phases = [p for p in phases if p["name"].removesuffix("_again") in want]
        variants = _variants(getattr(args, "net_variants", "") or "")
        if variants:  # A/B within one run: hook_k4 and each variant, twice, interleaved
            vph = [{"name": f"var_{v}", "steps": fo_steps, "servers": srv, **o} for v, o in variants.items()]
            ref = {"name": "hook_k4", "steps": fo_steps, "servers": srv, "keep": True}
            phases = [p for p in phases if p["name"] not in ("hook_k4", "hook_k4_again")]
            phases += [ref, *vph, {**ref, "name": "hook_k4_again", "keep": False},
                       *[{**p, "name": p["name"] + "_again"} for p in vph]]
        if phases:
            specs = {f"w{r}": {**base, "rank": r, "job": "net", "init": f"tcp://{cl.net.addrs['w0']}:{GLOO_PORT}",
                               "phases": phases} for r in range(n)}
            say("one job: " + ", ".join(p["name"] for p in phases) + " ...")
            res = cl.run_workers(specs, restart={cl.servers[victim]}, progress=lambda m: say(m))
        ran = {p["name"] for p in phases}
        if "compute_only" in ran:
            rows.append(_phase_row("compute_only", res, cl, W, [], 0.0))
        if "ring" in ran:
            rows.append(_phase_row("ring", res, cl, W, [], 2 * (n - 1) / n * grad / B, also=("ring_again",)))
        for k in (1, 2, 4):
            if f"hook_k{k}" in ran:
                rows.append(_phase_row(f"hook_k{k}", res, cl, W, S[:k], max(grad, n * grad / k) / B,
                                       also=("hook_k4_again",) if k == 4 else ()))
        for c in ("fp16", "bf16"):
            if f"hook_k4_{c}" in ran:
                rows.append(_phase_row(f"hook_k4_{c}", res, cl, W, S, max(grad, n * grad / 4) / 2 / B))
        for v in variants:
            rows.append(_phase_row(f"var_{v}", res, cl, W, S, grad / B, also=(f"var_{v}_again",)))
        if "failover_k4" in ran:
            rows.append(_phase_row("failover_k4", res, cl, W, S, max(grad, n * grad / 4) / B))
            fo = {w: res[w]["failover_k4"] for w in W}
            killed_at = fo["w0"].get("killed_at")
            back_at = cl.restarts.get(cl.servers[victim])
            if back_at:
                d = cl.sampler.delta(back_at, max(fo[w]["window"][1] for w in W))
                used_again = d["recv"][cl.servers[victim]] > 1e6
        for r in rows:
            mr = agg_timeline.median_round(res["w0"][r["phase"]], warmup)
            if mr is not None:
                mk = res["w0"][r["phase"]]["marks"][mr]
                rates[r["phase"]] = {**cl.sampler.rates(mk[0] - 0.1, mk[3] + 0.1, ["w0", "s0"]),
                                     "rate_mb_s": B / 1e6}

        if "two_jobs" in want:
            say("two jobs: each on its own ring, then both on the same 4 servers ...")
            two = []
            for phase, servers in (("own_ring", None), ("shared_k4", srv)):
                two.append({"name": phase, "steps": warmup + steps, "compute_s": compute_s,
                            **({"servers": servers} if servers else {})})
            names = [f"{j}/{r}" for j in ("A", "B") for r in range(n)]
            specs = {}
            for j, job in enumerate(("A", "B")):
                for r in range(n):
                    host = f"w{j * n + r}"
                    specs[host] = {**base, "rank": r, "job": job, "phases": two,
                                   "init": f"tcp://{cl.net.addrs[f'w{j * n}']}:{GLOO_PORT}",
                                   "barrier": {"host": cl.net.addrs["w0"], "port": STORE_PORT, "world": 2 * n,
                                               "master": host == "w0", "names": names}}
            res2 = cl.run_workers(specs, progress=lambda m: say(m))
            WA, WB = W, [f"w{r}" for r in range(n, 2 * n)]
            ring_b = compute_s + 2 * (n - 1) / n * grad / B
            shared_b = max(compute_s + grad / B, 2 * n * grad / 4 / B)  # perfect interleaving of the two jobs
            for job, ws in (("A", WA), ("B", WB)):
                jrows.append({**_phase_row("own_ring", res2, cl, ws, [], ring_b), "job": job})
                jrows.append({**_phase_row("shared_k4", res2, cl, ws, S, shared_b), "job": job})
            mr = agg_timeline.median_round(res2["w0"]["shared_k4"], warmup)
            if mr is not None:
                mk = res2["w0"]["shared_k4"]["marks"][mr]
                rates["two_jobs_shared_k4"] = {**cl.sampler.rates(mk[0] - 0.1, mk[3] + 0.1, ["w0", "w4", "s0"]),
                                               "rate_mb_s": B / 1e6}
        ok = True
    finally:
        cl.stop()
        signal.signal(signal.SIGTERM, prev)
        traces = cl.traces()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"agg --network: failed; the logs of every host are in {tmp}", file=sys.stderr, flush=True)
    by = {r["phase"]: r for r in rows}
    m: dict[str, Any] = {"net_rate_mbit": args.net_rate_mbit, "model_params": nparams, "grad_bytes": grad}
    if "ring" in by:
        m["ring_step_ms"], m["ring_bound_ms"] = by["ring"]["step_ms"], by["ring"]["bound_ms"]
    for k in (1, 2, 4):
        if f"hook_k{k}" in by:
            m[f"hook_k{k}_step_ms"] = by[f"hook_k{k}"]["step_ms"]
            m[f"net_step_vs_bound_k{k}"] = by[f"hook_k{k}"]["step_vs_bound"]
            if "ring" in by:
                m[f"net_step_vs_ring_k{k}"] = round(by[f"hook_k{k}"]["step_ms"] / by["ring"]["step_ms"], 3)
                m[f"bound_vs_ring_k{k}"] = round(by[f"hook_k{k}"]["bound_ms"] / by["ring"]["bound_ms"], 3)
    for c in ("fp16", "bf16"):
        if f"hook_k4_{c}" in by:
            m[f"compress_{c}_step_ms"] = by[f"hook_k4_{c}"]["step_ms"]
            m[f"net_step_vs_bound_k4_{c}"] = by[f"hook_k4_{c}"]["step_vs_bound"]
            m[f"compress_{c}_step_vs_fp32"] = round(by[f"hook_k4_{c}"]["step_ms"] / by["hook_k4"]["step_ms"], 3)
            m[f"compress_{c}_param_max_abs_diff"] = max(res[w][f"hook_k4_{c}"]["param_max_abs_diff"] for w in W)
    if fo:
        m["failover_param_diff"] = max(fo[w]["param_max_abs_diff"] for w in W)
        m["failover_retries"] = sum(fo[w].get("retries", 0) for w in W)
        m["failover_max_step_ms"] = round(max(max(fo[w]["step_s"]) for w in W) * 1e3, 1)
        m["failover_server_used_again"] = used_again
        m["failover_restart_after_kill_s"] = round(back_at - killed_at, 2) if back_at and killed_at else None
    overlap = None
    if jrows:
        jb = {(r["job"], r["phase"]): r for r in jrows}
        per_job = {j: jb[(j, "shared_k4")]["step_ms"] / jb[(j, "own_ring")]["step_ms"] for j in ("A", "B")}
        overlap = _overlap(res2["w0"]["shared_k4"]["comm"], res2[f"w{n}"]["shared_k4"]["comm"])
        m["two_jobs_compute_ms"] = round(compute_s * 1e3, 1)
        m["two_jobs_step_vs_own_ring"] = round(max(per_job.values()), 3)
        m["two_jobs_step_vs_own_ring_by_job"] = {j: round(v, 3) for j, v in per_job.items()}
        m["two_jobs_round_overlap"] = round(overlap, 3)
        m.update(_server_idle(traces, res2, n, warmup))
    m["max_machine_cpu_pct"] = max((r["machine_cpu_pct"] or 0 for r in rows + jrows), default=None)
    m["elapsed_s"] = round(time.perf_counter() - t_start, 1)

    # where each step's time goes, and one step of each phase with every stage
    stage_rows, steps_drawn = [], {}
    for r in rows:
        name = r["phase"]
        job = f"net-{name}" if name.startswith(("hook", "failover", "var_")) else None
        spb = {"ring": 2 * (n - 1) / n / B, "hook_k1": n / B, "hook_k2": n / 2 / B, "hook_k4": 1 / B,
               "failover_k4": 1 / B, "hook_k4_fp16": 0.5 / B, "hook_k4_bf16": 0.5 / B}.get(
            name, 1 / B if name.startswith("var_") else 0.0)
        b = agg_timeline.breakdown(res["w0"][name], warmup, list(traces.values()), job, spb,
                                   peers=[res[w][name] for w in W[1:]])
        stage_rows.append({"phase": name, "bound_ms": r["bound_ms"], **b, "tcp": r.get("tcp")})
        mr = agg_timeline.median_round(res["w0"][name], warmup)
        if mr is not None:
            steps_drawn[name] = agg_timeline.one_step(res, W, name, mr, traces, job)
        if name == "failover_k4":  # and the step a server was killed in
            steps_drawn["failover_k4_killed"] = agg_timeline.one_step(res, W, name, warmup + 1, traces, job)
    if jrows:
        for job, w in (("A", "w0"), ("B", f"w{n}")):
            b = agg_timeline.breakdown(res2[w]["shared_k4"], warmup, list(traces.values()), f"{job}-shared_k4")
            stage_rows.append({"phase": f"two_jobs_{job}", "bound_ms": None, **b})
        mr = agg_timeline.median_round(res2["w0"]["shared_k4"], warmup)
        if mr is not None:
            st = agg_timeline.one_step(res2, [f"w{i}" for i in range(2 * n)], "shared_k4", mr, None, None)
            st["servers"] = {s: [u for u in tr["units"] if u["round"] == mr and u["job"].endswith("shared_k4")]
                             for s, tr in traces.items()}
            steps_drawn["two_jobs_shared_k4"] = st
    checks = [
        ("net_step_vs_bound_k4 <= 1.15", m.get("net_step_vs_bound_k4"), "<=", 1.15),
        ("net_step_vs_ring_k4 <= 0.75 (bound 0.67)", m.get("net_step_vs_ring_k4"), "<=", 0.75),
        ("net_step_vs_bound_k4_fp16 <= 1.3", m.get("net_step_vs_bound_k4_fp16"), "<=", 1.3),
        ("net_step_vs_ring_k2 (report; bound 1.33)", m.get("net_step_vs_ring_k2"), "<=", None),
        ("two_jobs_step_vs_own_ring <= 0.9", m.get("two_jobs_step_vs_own_ring"), "<=", 0.9),
        ("failover_param_diff == 0", m.get("failover_param_diff"), "==", 0.0),
    ]
    targets = report.target_rows(checks)
    cols = ["phase", "steps", "step_ms", "bound_ms", "step_vs_bound", "worker_sent_mb", "worker_recv_mb", "server_recv_mb",
            "server_sent_mb", "worker_cpu_pct", "worker_wakeups", "server_cpu_pct", "machine_cpu_pct", "retrans_segs"]
    print(report.markdown_table(rows, cols))
    if jrows:
        print(report.markdown_table(jrows, ["job", *cols]))
    scols = ["phase", "bound_ms", "step", "ready_floor", "comm_over_floor", "ready_floor_all", "framed_floor_all",
             "comm_over_framed_floor", "before_comm", "comm", "after_comm", "buckets_handed_over",
             "first_push_after_first_ready", "last_push_done", "server_last_arrival", "server_last_sum",
             "last_result_in", "last_future_done"]
    print(report.markdown_table(stage_rows, scols))
    print(report.markdown_table([{"metric": k, "value": v} for k, v in m.items() if not isinstance(v, dict)],
                                ["metric", "value"]))
    print(report.markdown_table(targets, ["target", "value", "op", "bound", "met"]))
    timeline = {"A": res2["w0"]["shared_k4"]["comm"], "B": res2[f"w{n}"]["shared_k4"]["comm"]} if jrows else {}
    plot = _plot(rows, jrows, timeline, m, getattr(args, "json", None)) if "hook_k4" in by else None
    stage_plot = None
    if steps_drawn:
        stage_plot = agg_timeline.plot(steps_drawn, rates,
                                       report.out_dir(getattr(args, "json", None)) / "agg_network_timeline.png")
    return report.envelope("agg-network", m, phases=rows, two_jobs=jrows, targets=targets, plot=str(plot),
                           timeline=timeline, stages=stage_rows, steps=steps_drawn, link_rates=rates,
                           stage_plot=str(stage_plot),
                           params={"quick": quick, "rate_bit": rate_bit, "width": width, "batch": batch,
                                   "warmup": warmup, "steps": steps, "phases": want,
                                   "chunk_bytes": chunk or chunk_for_link(B, 4, n),
                                   "window_chunks": base.get("window_chunks"),
                                   "workers": n, "compute_s": compute_s})


def _variants(text: str) -> dict[str, dict[str, int]]:
    """``NAME:WINDOW:CHUNK_KB,...`` -> phase options (development A/B runs)."""
    out = {}
    for part in [p for p in text.split(",") if p]:
        try:
            name, window, kb = part.split(":")
            out[name] = {"window_chunks": int(window), **({"chunk_bytes": int(kb) * 1024} if int(kb) else {})}
        except ValueError:
            raise SystemExit(f"dlshare bench agg --network: --net-variants wants NAME:WINDOW:CHUNK_KB, not {part!r}")
    return out


def _server_idle(traces: dict[str, dict], res2: dict[str, dict], n: int, warmup: int) -> dict[str, Any]:
    """Two jobs on shared servers: of each measured step's span, how long each server received nothing."""
    starts = res2["w0"]["shared_k4"]["marks"]
    if len(starts) <= warmup:
        return {}
    t0, t1 = starts[warmup][0], starts[-1][3]
    idle = {}
    for s, tr in traces.items():
        iv = sorted((min(a[0] for a in u["arrived"].values()), max(a[1] for a in u["arrived"].values()))
                    for u in tr["units"] if u["job"].endswith("shared_k4") and u["arrived"])
        busy, cur = 0.0, None
        for a, b in iv:
            a, b = max(a, t0), min(b, t1)
            if b <= a:
                continue
            if cur and a <= cur[1]:
                cur[1] = max(cur[1], b)
            else:
                if cur:
                    busy += cur[1] - cur[0]
                cur = [a, b]
        if cur:
            busy += cur[1] - cur[0]
        idle[s] = round(1 - busy / max(1e-9, t1 - t0), 3)
    return {"two_jobs_server_recv_idle": idle}


def _plot(rows: list[dict], jrows: list[dict], timeline: dict, m: dict, json_path: str | None) -> Path:
    plt = report.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    by = {r["phase"]: r for r in rows}
    ks = [k for k in (1, 2, 4) if f"hook_k{k}" in by]
    ax1.plot(ks, [by[f"hook_k{k}"]["step_ms"] for k in ks], "o-", label="DDP + dlshare hook (measured)")
    ax1.plot(ks, [by[f"hook_k{k}"]["bound_ms"] for k in ks], "o--", color="tab:blue", alpha=0.5,
             label="hook bound max(M, nM/k)/B")
    if "ring" in by:
        ax1.axhline(by["ring"]["step_ms"], color="tab:red", label="DDP, gloo ring (measured)")
        ax1.axhline(by["ring"]["bound_ms"], color="tab:red", ls="--", alpha=0.5, label="ring bound 2(n-1)/n M/B")
    if "hook_k4_fp16" in by:
        ax1.plot([4], [by["hook_k4_fp16"]["step_ms"]], "s", color="tab:green", label="hook k=4, fp16 wire")
    ax1.set_xticks([1, 2, 4])
    ax1.set_xlabel("aggregation server hosts k (n = 4 workers)")
    ax1.set_ylabel("step time (ms)")
    ax1.set_ylim(bottom=0)
    ax1.set_title(f"step time vs k at {m['net_rate_mbit']:g} Mbit/s links")
    ax1.legend(fontsize=8)
    t0 = min((w[0] for iv in timeline.values() for w in iv), default=0.0)
    for y, (job, iv) in enumerate(sorted(timeline.items())):
        ax2.broken_barh([(s - t0, e - s) for s, e in iv if e > s], (y - 0.35, 0.7),
                        color=["tab:blue", "tab:orange"][y], label=f"job {job}")
    ax2.set_yticks([0, 1], ["job A", "job B"])
    ax2.set_xlabel("seconds")
    if timeline:
        ax2.set_title(f"two jobs on 4 shared servers: rounds in flight (overlap {m['two_jobs_round_overlap']:.2f})")
    fig.tight_layout()
    path = report.out_dir(json_path) / "agg_network.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
