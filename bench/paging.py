"""``dlshare bench paging``: whole programs on remote memory, against all-local, disk swap and memmap.

Each program (bench/paging_work.py) runs in its own process inside a cgroup (v1 here) whose memory
limit is the process's own footprint before its working set (measured in that run) plus a share of
the working set: 50% or 25%.  Same run, same limit, one variant after the other:

- **local**: no limit at all (the upper bound);
- **region**: the working set in a RemoteRegion on donors (2 copies), ``local_bytes`` = the share;
- **swap**: the same program with ordinary memory, and a swapfile on the local disk (``mkswap`` /
  ``swapon`` for this run only, the Infiniswap baseline); reported unavailable, with the reason,
  when the machine refuses;
- **memmap**: the working set in ``np.memmap`` of a file on the local disk.

Workloads: a DLRM-style training loop (samples/s) and a shuffle-and-scan (GB/s); a region's stream
(4 MiB chunks in a random order, each read in order) against the data plane's batched reads of the
same bytes, at the default unit (the target) and at ``STREAM_UNIT``; also fault latency
(4 KiB and unit-sized units, against a raw socket round trip measured in this run), bytes lost when
a donor is ``kill -9``ed mid-run, a DLRM run's slowdown when a donor is ``kill -9``ed a third of the
way in (against the same run without the kill, run just before it) and the CPU the rebuild took, in
the job's process and in the donors, and a sweep of unit sizes and eviction policies.  Swapfiles and
cgroups are torn down on every exit path.  Donors are real node daemons on a real broker.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import report
from bench.memory import Cluster, EchoBaseline, _pcts
from bench.paging_host import MemoryLimit, Swapfile, disk_read_latency, vmstat

MIB = 1 << 20
GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
MARGIN = 64 * MIB  # every variant's limit: own charged footprint + share of the working set + this
DEFAULT_UNIT = 4 << 10
# The stream is also measured with units this large: the unit is each region's choice, and a region
# read in long runs (an input pipeline's files) costs less CPU a byte in large units (RESULTS, issue
# 21: 0.78 s against 1.01 s of program CPU for the same stream at 256 KiB and 4 KiB units).  A figure
# beside the target's, which stays at DEFAULT_UNIT.
STREAM_UNIT = 256 << 10
STREAM_BIG = f"stream_unit{STREAM_UNIT >> 10}k"  # its runs' key, and its metrics' prefix


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    if "--working-set" not in seen:
        parser.add_argument("--working-set", type=int, default=0, metavar="BYTES",
                            help="paging bench: working set of each program (default 256 MiB quick, 1 GiB full)")
        seen.add("--working-set")


# --- one program under one limit ---------------------------------------------------------------------

def run_program(workload: str, mode: str, share: float | None, ws: int, tmp: Path, extra: list[str],
                swap: bool = False, timeout: float = 900.0, on_line=None, margin: int = MARGIN) -> dict[str, Any]:
    """Run one program; share None: no limit.  Returns its result (or {"error": ...})."""
    name = f"{workload}-{mode}-{'nolimit' if share is None else int(share * 100)}-{os.getpid()}-{time.monotonic_ns()}"
    cg = MemoryLimit(name) if share is not None else None
    cmd = [sys.executable, "-m", "bench.paging_work", workload, "--mode", mode, "--ws", str(ws), "--dir", str(tmp),
           *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=cg.join if cg else None)
    out: dict[str, Any] = {"workload": workload, "mode": mode, "share": share, "swap": swap}
    err_lines: list[str] = []
    threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True).start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for ev, msg in report.json_events(proc.stdout):
            if ev == "ready":
                out["base_rss"] = msg["base_rss"]
                local = 0
                if share is not None:
                    local = int(share * ws)
                    out["base_charged"] = cg.usage()
                    out["limit_bytes"] = out["base_charged"] + local + margin
                    cg.limit(out["limit_bytes"], swap)
                proc.stdin.write(f"go {local or ws}\n")
                proc.stdin.flush()
            elif ev == "result":
                out.update(msg)
            elif on_line is not None:
                on_line(ev, msg, proc)
        proc.wait(30)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if cg is not None:
            out["cgroup"] = cg.stats()
            cg.remove()
    if not any(k in out for k in ("samples_per_s", "gbps", "fault", "lost_bytes", "stream_gbps")):
        out["error"] = (f"exit {proc.returncode}"
                        + (" (OOM-killed)" if out.get("cgroup", {}).get("oom_kills") else "")
                        + ": " + "".join(err_lines[-5:]).strip()[-400:])
    return out


def _stop_bench(signum, frame) -> None:
    raise SystemExit(f"bench stopped by signal {signum}")


def _value(r: dict[str, Any]) -> float | None:
    return r.get("samples_per_s", r.get("gbps"))


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    va, vb = (_value(a) if a else None), (_value(b) if b else None)
    return va / vb if va and vb else None


# --- the bench ----------------------------------------------------------------------------------------

def median_range(values: list[float]) -> tuple[float | None, float | None, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return None, None, None
    return float(np.median(v)), float(min(v)), float(max(v))


VARIANTS = {  # name -> (mode, share, swap)
    "local": ("local", None, False),
    "region50": ("region", 0.5, False),
    "region25": ("region", 0.25, False),
    "memmap50": ("memmap", 0.5, False),
    "swap50": ("local", 0.5, True),
    "swap25": ("local", 0.25, True),
}


def halt_polling_note(idle: dict[str, Any]) -> str | None:
    """What the fault and stream figures owe to how this machine wakes idle vCPUs, or None."""
    if not idle.get("virtual") or idle.get("guest_halt_poll_ns"):
        return None
    why = ("guest_halt_poll_ns = 0" if idle.get("guest_halt_poll_ns") == 0
           else f"cpuidle driver {idle.get('cpuidle_driver') or 'unknown'}, no guest halt polling")
    return (f"a virtual machine without guest halt polling ({why}): each wake-up of an idle vCPU goes through "
            "the hypervisor, and a fault's three hand-offs between threads pay it; the fault latency and the "
            "stream here are the figures of such a machine (bench/RESULTS.md measures both settings)")


def run(args) -> dict[str, Any]:
    """Rounds of every variant, interleaved (local, region, memmap, swap, then again), so that a cold
    start or a neighbour's burst lands on one round of one variant, not on one variant; the metrics
    are medians over the rounds, with their range."""
    quick = bool(getattr(args, "quick", False))
    ws = int(getattr(args, "working_set", 0) or (256 * MIB if quick else GIB))
    rounds = 2 if quick else 3
    dlrm_args = ["--steps", "30" if quick else "80", "--warmup", "5", "--batch", "1024"]
    scan_args = ["--passes", "2" if quick else "4"]
    units = [4 << 10, 16 << 10, 64 << 10] if quick else [4 << 10, 16 << 10, 64 << 10, 256 << 10]
    policies = ["clock", "fifo"] if quick else ["clock", "fifo", "random"]
    variants = ["local", "region50", "region25", "memmap50", "swap50"] + ([] if quick else ["swap25"])
    notes: list[str] = []
    load0 = os.getloadavg()[0]
    if load0 >= 0.5:
        msg = (f"load average {load0:.2f} at the start (>= 0.5): figures taken beside other work cannot tell a "
               "change from noise; do not record them")
        notes.append(msg)
        print(f"WARNING: {msg}", flush=True)
    halt_note = halt_polling_note(report.idle_settings())
    if halt_note:
        notes.append(halt_note)
        print(f"NOTE: {halt_note}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    budget = ["--max-seconds", "20" if quick else "60"]  # a slow baseline (memmap) ends its timed part early
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dlshare-bench-paging-", dir="/var/tmp"))
    restore = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in restore:  # a kill of the bench still tears the swapfile and the cgroups down
        signal.signal(s, _stop_bench)
    echo = EchoBaseline()
    cluster = Cluster(3, 64 * MIB, tmp)
    region = ["--broker", cluster.url]
    swap_reason: str | None = None
    raw: list[np.ndarray] = []
    try:
        def go(key: str, workload: str, mode: str, share: float | None, extra: list[str], rnd: int = 0,
               **kw) -> dict[str, Any]:
            t = time.perf_counter()
            load = os.getloadavg()[0]
            vm0 = vmstat()
            dc0 = cluster.cpu_s()
            r = run_program(workload, mode, share, ws, tmp, extra + budget, **kw)
            if r.get("error") and kw.get("swap") and r.get("cgroup", {}).get("oom_kills"):
                # v1 charges swap-in readahead (the swap cache) to the group: a tight limit can OOM the
                # swap baseline where it would only be slow; give it another margin, and say so
                notes.append(f"{key} round {rnd}: OOM-killed at {r['limit_bytes'] >> 20} MiB during swap-in; "
                             f"rerun with {MARGIN >> 20} MiB more")
                vm0 = vmstat()
                r = run_program(workload, mode, share, ws, tmp, extra + budget, margin=2 * MARGIN, **kw)
            vm1 = vmstat()
            r["donors_cpu_s"] = cluster.cpu_s() - dc0  # the donors serve on the same two cores here
            r.update(round=rnd, wall_s=time.perf_counter() - t, load_start=load, load_end=os.getloadavg()[0],
                     pswpin_pages=vm1.get("pswpin", 0) - vm0.get("pswpin", 0),
                     pswpout_pages=vm1.get("pswpout", 0) - vm0.get("pswpout", 0))
            runs.setdefault(key, []).append(r)
            print(f"  round {rnd} {key}: {_value(r) or r.get('stream_gbps') or r.get('error') or ''} "
                  f"({r['wall_s']:.0f} s, load {load:.2f})", flush=True)
            return r

        def variant(wl: str, name: str, wargs: list[str], rnd: int) -> None:
            mode, share, swap = VARIANTS[name]
            extra = wargs + (region if mode == "region" else [])
            if not swap:
                go(f"{wl}_{name}", wl, mode, share, extra, rnd)
                return
            nonlocal swap_reason
            if swap_reason is not None:
                return
            try:  # swap on for this variant only: the others must not page to disk behind our back
                with Swapfile(tmp, int(ws * 1.5) + 256 * MIB):
                    go(f"{wl}_{name}", wl, mode, share, extra, rnd, swap=True)
            except RuntimeError as exc:
                swap_reason = str(exc)
                notes.append(f"disk swap baseline unavailable: {swap_reason}")

        def phases(ev, msg, proc) -> None:  # the donors' CPU over each phase of the stream workload
            if ev == "phase":
                mark = phases.marks
                if mark:
                    phases.out.setdefault(mark[0], []).append(cluster.cpu_s() - mark[1])
                phases.marks = (msg.get("name"), cluster.cpu_s())

        def killer(ev, msg, proc) -> None:
            if ev == "running":
                victim = next(iter(cluster.procs))
                cluster.kill9(victim)
                proc.stdin.write("killed\n")
                proc.stdin.flush()

        for rnd in range(rounds):
            for wl, wargs in (("dlrm", dlrm_args), ("scan", scan_args)):
                for name in variants:
                    variant(wl, name, wargs, rnd)
            phases.marks, phases.out = None, {}
            r = go("stream", "stream", "region", None, region + ["--passes", "2" if quick else "3"], rnd,
                   on_line=phases)
            r["donors_cpu_by_phase_s"] = phases.out
            go(STREAM_BIG, "stream", "region", None,
               region + ["--passes", "2" if quick else "3", "--unit", str(STREAM_UNIT)], rnd)
            raw.append(echo.measure(1000))
            go("latency", "latency", "region", None, region + ["--units", "4096", str(64 << 10),
                                                               "--samples", "400" if quick else "2000"], rnd)
            raw.append(echo.measure(1000))
            # a donor kill -9 a third of the way into a DLRM run at 50%, against the same run without
            # it just before (the round's region50 ran minutes earlier, before the scan, the streams
            # and the latencies: a drift of the machine in between would land on the ratio), then the
            # donor comes back for the next round
            go("dlrm_region50_nokill", "dlrm", "region", 0.5, dlrm_args + region, rnd)
            go("dlrm_region50_kill", "dlrm", "region", 0.5, dlrm_args + region + ["--kill-mid-run"], rnd,
               on_line=killer)
            cluster.restart_dead()
        go("kill", "kill", "region", 0.25, region + ["--unit", str(DEFAULT_UNIT)], on_line=killer)
        cluster.restart_dead()
        if not quick:  # the sweeps, once each (the rounds above carry the headline figures)
            for wl, wargs in (("dlrm", dlrm_args), ("scan", scan_args)):
                for u in units:
                    if u != DEFAULT_UNIT:
                        go(f"{wl}_region50_unit{u >> 10}k", wl, "region", 0.5, wargs + region + ["--unit", str(u)])
                for pol in policies:
                    if pol != "clock":
                        go(f"{wl}_region50_{pol}", wl, "region", 0.5, wargs + region + ["--policy", pol])
        try:
            disk = disk_read_latency(tmp)
        except OSError as exc:
            disk = {}
            notes.append(f"disk read latency not measured: {exc}")
    finally:
        cluster.close()
        echo.close()
        for s, h in restore.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)
    return _results(runs, raw, disk, notes, quick, ws, rounds, swap_reason, units, policies, t_start,
                    getattr(args, "json", None))


def _per_round(runs: dict[str, list[dict[str, Any]]], key: str, base: str) -> list[float | None]:
    """key/base of each round that has both."""
    b = {r["round"]: _value(r) for r in runs.get(base, [])}
    return [(_value(r) / b[r["round"]]) if _value(r) and b.get(r["round"]) else None for r in runs.get(key, [])]


def kill_slowdowns(runs: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """Per round, the DLRM run without a kill over the run with one (the pair run back to back), as a
    time ratio: 1.25 when the kill cost a quarter more time."""
    return [1 / x if x else None for x in _per_round(runs, "dlrm_region50_kill", "dlrm_region50_nokill")]


def kill_extra_cpu(runs: dict[str, list[dict[str, Any]]], field: str) -> list[float | None]:
    """Per round, what the kill run's ``field`` (CPU seconds: ``program_cpu_s``, the job's process;
    ``donors_cpu_s``, the donor daemons) exceeds the run just before it by: the rebuild's work, and
    where it ran."""
    base = {r["round"]: r.get(field) for r in runs.get("dlrm_region50_nokill", [])}
    return [r[field] - base[r["round"]] if r.get(field) is not None and base.get(r["round"]) is not None
            else None for r in runs.get("dlrm_region50_kill", [])]


def kill_from_memory_mb(runs: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """Per kill run, the MB of its rebuild the job sent from its own memory (the units it held) instead
    of reading them from a surviving copy: the engine's ``rebuild_resident_bytes``."""
    out: list[float | None] = []
    for r in runs.get("dlrm_region50_kill", []):
        b = (r.get("region_stats") or {}).get("rebuild_resident_bytes")
        out.append(None if b is None else b / 1e6)
    return out


def _results(runs, raw, disk, notes, quick, ws, rounds, swap_reason, units, policies, t_start,
             json_path) -> dict[str, Any]:
    m: dict[str, Any] = {"working_set_bytes": ws, "rounds": rounds, "unit_bytes": DEFAULT_UNIT,
                         "swap_available": swap_reason is None}
    ranges: dict[str, list[float | None]] = {}

    def ratio(name: str, key: str, base: str) -> None:
        per = _per_round(runs, key, base)
        ranges[name] = per
        m[name] = median_range(per)[0]

    for wl in ("dlrm", "scan"):
        ratio(f"{wl}_local50_vs_local", f"{wl}_region50", f"{wl}_local")
        ratio(f"{wl}_local25_vs_local", f"{wl}_region25", f"{wl}_local")
        ratio(f"{wl}_local50_vs_memmap", f"{wl}_region50", f"{wl}_memmap50")
        # swap: a baseline that did not page (pages swapped in during the run = 0) is no baseline
        swaps = runs.get(f"{wl}_swap50", [])
        m[f"{wl}_swap50_pswpin_pages"] = median_range([r.get("pswpin_pages") for r in swaps])[0]
        paged = [r for r in swaps if r.get("pswpin_pages")]
        if swaps and not paged:
            notes.append(f"{wl}_swap50 swapped nothing in (pswpin = 0 in every round): it did not page, so its "
                         "ratio is not reported")
        ratio(f"{wl}_local50_vs_swap", f"{wl}_region50", f"{wl}_swap50")
        if not paged:
            m[f"{wl}_local50_vs_swap"] = None
    m["swap50_pswpin_pages"] = m.get("dlrm_swap50_pswpin_pages")
    streams = runs.get("stream", [])
    m["stream_gbps"] = median_range([r.get("stream_gbps") for r in streams])[0]
    m["dataplane_gbps"] = median_range([r.get("dataplane_gbps") for r in streams])[0]
    ranges["stream_vs_dataplane"] = [r["stream_gbps"] / r["dataplane_gbps"] if r.get("dataplane_gbps") else None
                                     for r in streams]
    m["stream_vs_dataplane"] = median_range(ranges["stream_vs_dataplane"])[0]
    m[f"{STREAM_BIG}_gbps"] = median_range([r.get("stream_gbps") for r in runs.get(STREAM_BIG, [])])[0]
    ranges[f"{STREAM_BIG}_vs_dataplane"] = [r["stream_gbps"] / r["dataplane_gbps"] if r.get("dataplane_gbps") else None
                                     for r in runs.get(STREAM_BIG, [])]
    m[f"{STREAM_BIG}_vs_dataplane"] = median_range(ranges[f"{STREAM_BIG}_vs_dataplane"])[0]
    lats = [r.get("fault", {}) for r in runs.get("latency", [])]
    for size, name in ((4096, "4k"), (64 << 10, "64k")):
        for q in ("p50", "p99"):
            m[f"fault_{name}_{q}_us"] = median_range([f.get(str(size), {}).get(f"{q}_us") for f in lats])[0]
    m["fault_unit_p50_us"], m["fault_unit_p99_us"] = m["fault_4k_p50_us"], m["fault_4k_p99_us"]
    if raw:
        m["raw_socket_rtt_p50_us"], m["raw_socket_rtt_p99_us"] = _pcts(np.concatenate(raw))
        ranges["fault_4k_vs_rtt"] = [f.get("4096", {}).get("p50_us") / _pcts(r)[0] if f.get("4096") else None
                                     for f, r in zip(lats, raw[1::2])]
        m["fault_4k_vs_rtt"] = (m["fault_4k_p50_us"] / m["raw_socket_rtt_p50_us"]
                                if m["fault_4k_p50_us"] and m["raw_socket_rtt_p50_us"] else None)
    m.update(disk)
    m["donor_kill_lost_bytes"] = (runs.get("kill") or [{}])[0].get("lost_bytes")
    ranges["donor_kill_slowdown"] = kill_slowdowns(runs)
    m["donor_kill_slowdown"] = median_range(ranges["donor_kill_slowdown"])[0]
    # the other side of that figure: how long the region stayed short of a copy (kill to healthy)
    m["donor_kill_rebuild_s"] = median_range([r.get("rebuild_s") for r in runs.get("dlrm_region50_kill", [])])[0]
    # and what the rebuild cost, in CPU: the job's own process (what stays on the job's node on a real
    # cluster) and the donors (other hosts there; the same two cores here)
    for name, field in (("donor_kill_program_cpu_s", "program_cpu_s"), ("donor_kill_donors_cpu_s", "donors_cpu_s")):
        ranges[name] = kill_extra_cpu(runs, field)
        m[name] = median_range(ranges[name])[0]
    ranges["donor_kill_rebuild_from_memory_mb"] = kill_from_memory_mb(runs)
    m["donor_kill_rebuild_from_memory_mb"] = median_range(ranges["donor_kill_rebuild_from_memory_mb"])[0]
    for k, rs in runs.items():
        v = median_range([_value(r) for r in rs])
        if v[0] is not None:
            m[f"{k}_{'samples_per_s' if 'samples_per_s' in rs[0] else 'gbps'}"] = v[0]
    sweep = {wl: {"unit": {str(u): median_range([_value(r) for r in runs.get(
                      f"{wl}_region50" if u == DEFAULT_UNIT else f"{wl}_region50_unit{u >> 10}k", [])])[0]
                           for u in units},
                  "policy": {p: median_range([_value(r) for r in runs.get(
                      f"{wl}_region50" if p == "clock" else f"{wl}_region50_{p}", [])])[0] for p in policies}}
             for wl in ("dlrm", "scan")}
    for k, rs in runs.items():
        for r in rs:
            if r.get("error"):
                notes.append(f"{k} round {r.get('round')}: {r['error']}")
    targets = report.target_rows([
        ("stream_vs_dataplane >= 0.7", m["stream_vs_dataplane"], ">=", 0.7),
        ("scan_local50_vs_local >= 0.4", m["scan_local50_vs_local"], ">=", 0.4),
        ("scan_local50_vs_memmap >= 2", m["scan_local50_vs_memmap"], ">=", 2.0),
        ("fault_4k_p50_us / raw_socket_rtt_p50_us <= 1.5", m.get("fault_4k_vs_rtt"), "<=", 1.5),
        ("dlrm_local50_vs_local >= 0.8", m["dlrm_local50_vs_local"], ">=", 0.8),
        ("dlrm_local25_vs_local >= 0.5", m["dlrm_local25_vs_local"], ">=", 0.5),
        ("donor_kill_lost_bytes == 0", m["donor_kill_lost_bytes"], "==", 0),
        ("donor_kill_slowdown <= 1.1", m["donor_kill_slowdown"], "<=", 1.1),
    ])
    m["bench_s"] = time.perf_counter() - t_start
    result = report.envelope("paging", m, targets=targets, ranges=ranges, sweep=sweep, runs=runs, notes=notes,
                             quick=quick, swap_unavailable_reason=swap_reason)
    _print(result)
    _plot(result, json_path)
    return result


def _fmt(med: float | None, lo: float | None, hi: float | None, digits: int = 3) -> str:
    if med is None:
        return "-"
    if lo is None or hi is None or lo == hi:
        return f"{med:.{digits}g}"
    return f"{med:.{digits}g} [{lo:.{digits}g}-{hi:.{digits}g}]"


def _print(result: dict[str, Any]) -> None:
    m, runs = result["metrics"], result["runs"]
    rows = []
    for k, rs in runs.items():
        vals = [_value(r) for r in rs]
        if not any(v is not None for v in vals):
            continue
        r0 = rs[0]
        rows.append({"run": k, "median [range]": _fmt(*median_range(vals)), "rounds": len(rs),
                     "unit": "samples/s" if "samples_per_s" in r0 else "GB/s",
                     "limit MiB": round(r0["limit_bytes"] / MIB) if r0.get("limit_bytes") else "-",
                     "swapped in (pages)": ",".join(str(r.get("pswpin_pages", 0)) for r in rs) if r0.get("swap") else "-",
                     "load at start": ",".join(f"{r.get('load_start', 0):.2f}" for r in rs)})
    print(f"\n## paging ({'quick' if result['quick'] else 'full'}, working set {m['working_set_bytes'] // MIB} MiB, "
          f"{m['rounds']} rounds interleaved)\n")
    print(report.markdown_table(rows, ["run", "median [range]", "rounds", "unit", "limit MiB", "swapped in (pages)",
                                       "load at start"]))
    lat = [{"measure": k, "value": m.get(k)} for k in ("stream_gbps", "dataplane_gbps", "stream_vs_dataplane",
                                                   f"{STREAM_BIG}_gbps", f"{STREAM_BIG}_vs_dataplane",
                                                   "fault_4k_p50_us", "fault_4k_p99_us", "fault_64k_p50_us",
                                                   "fault_64k_p99_us", "raw_socket_rtt_p50_us",
                                                   "raw_socket_rtt_p99_us", "fault_4k_vs_rtt",
                                                   "disk_read_4k_p50_us", "disk_read_4k_p99_us",
                                                   "swap50_pswpin_pages", "donor_kill_lost_bytes",
                                                   "donor_kill_slowdown", "donor_kill_rebuild_s",
                                                   "donor_kill_program_cpu_s", "donor_kill_donors_cpu_s",
                                                   "donor_kill_rebuild_from_memory_mb")]
    print(report.markdown_table(lat, ["measure", "value"]))
    rng = [{"figure": k, "per round": ", ".join("-" if v is None else f"{v:.3g}" for v in vals)}
           for k, vals in result.get("ranges", {}).items()]
    print(report.markdown_table(rng, ["figure", "per round"]))
    for wl, sw in result["sweep"].items():
        print(f"sweep {wl}: units {sw['unit']}, policies {sw['policy']}")
    report.print_targets_and_notes(result)


def _plot(result: dict[str, Any], json_path: str | None) -> None:
    plt = report.pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, wl, unit in ((axes[0], "dlrm", "samples/s"), (axes[1], "scan", "GB/s")):
        names = [("local", "all local"), ("region50", "region 50%"), ("region25", "region 25%"),
                 ("swap50", "disk swap 50%"), ("memmap50", "memmap 50%")]
        base = median_range([_value(r) for r in runs.get(f"{wl}_local", [])])[0] or 1.0
        labels, vals, errs = [], [], [[], []]
        for key, label in names:
            med, lo, hi = median_range([_value(r) for r in runs.get(f"{wl}_{key}", [])])
            labels.append(label)
            vals.append(med / base if med else 0.0)
            errs[0].append((med - lo) / base if med else 0.0)
            errs[1].append((hi - med) / base if med else 0.0)
        bars = ax.bar(labels, vals, yerr=errs, capsize=3, color=["#888", "#1f77b4", "#6baed6", "#d62728", "#ff9896"])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}" if v else "n/a", ha="center", va="bottom")
        ax.set_title(f"{wl}: throughput vs all local ({base:.3g} {unit})")
        ax.set_ylabel("fraction of all-local throughput (median, range)")
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"dlshare paging, working set {result['metrics']['working_set_bytes'] // MIB} MiB, "
                 f"{result['metrics']['rounds']} rounds, local memory capped by a cgroup limit")
    out = report.out_dir(json_path) / "paging_throughput.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
