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

Workloads: a DLRM-style training loop (samples/s) and a shuffle-and-scan (GB/s); also fault latency
(4 KiB and unit-sized units, against a raw socket round trip measured in this run), bytes lost when
a donor is ``kill -9``ed mid-run, and a sweep of unit sizes and eviction policies.  Swapfiles and
cgroups are torn down on every exit path.  Donors are real node daemons on a real broker.
"""

from __future__ import annotations

import argparse
import json
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

MIB = 1 << 20
GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
MARGIN = 64 * MIB  # every variant's limit: own charged footprint + share of the working set + this
DEFAULT_UNIT = 4 << 10


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    if "--working-set" not in seen:
        parser.add_argument("--working-set", type=int, default=0, metavar="BYTES",
                            help="paging bench: working set of each program (default 256 MiB quick, 1 GiB full)")
        seen.add("--working-set")


# --- a memory cgroup for one process ----------------------------------------------------------------

class MemoryLimit:
    """A cgroup v1 memory group for one program: created empty, the child joins it before it
    executes, the limit is set once the program says how big it is without its working set."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str) -> None:
        if not (self.ROOT / "memory.limit_in_bytes").exists():
            raise RuntimeError("needs the cgroup v1 memory controller at /sys/fs/cgroup/memory (this bench "
                               "drives v1, as the development machines mount it)")
        own = "/"
        for line in open("/proc/self/cgroup"):
            parts = line.strip().split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                own = parts[2]
        self.path = self.ROOT / own.lstrip("/") / "dlshare-bench" / name
        self.path.mkdir(parents=True, exist_ok=True)

    def join(self) -> None:
        """For preexec_fn: the child moves itself in before it executes the program."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def limit(self, nbytes: int, swap: bool) -> None:
        memsw = self.path / "memory.memsw.limit_in_bytes"
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))
        if memsw.exists():  # swap allowed only for the swap baseline
            memsw.write_text("-1" if swap else str(nbytes))

    def usage(self) -> int:
        """Bytes charged to the group now: what the limit counts (RSS also counts shared library
        pages that other processes brought in, which this group is never charged for)."""
        return int((self.path / "memory.usage_in_bytes").read_text())

    def stats(self) -> dict[str, int]:
        out = {}
        for f, k in (("memory.max_usage_in_bytes", "max_usage_bytes"), ("memory.failcnt", "failcnt"),
                     ("memory.memsw.max_usage_in_bytes", "max_usage_with_swap_bytes")):
            try:
                out[k] = int((self.path / f).read_text())
            except OSError:
                pass
        try:
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        except (OSError, ValueError):
            pass
        return out

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the exited process is still being torn down


def disk_read_latency(directory: Path, nbytes: int = 64 * MIB, n: int = 2000) -> dict[str, float]:
    """4 KiB O_DIRECT random reads of a file on the disk the swapfile and memmap use: what a page-in
    from that disk costs here (a virtual disk served from the host's page cache is far faster than
    a real SSD)."""
    path = directory / "disk-probe.bin"
    buf = np.frombuffer(os.urandom(MIB), np.uint8)
    with open(path, "wb") as fh:
        for _ in range(nbytes // MIB):
            fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
    import mmap

    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        page = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
        rng = np.random.default_rng(6)
        lat = np.empty(n, np.int64)
        for i, blk in enumerate(rng.integers(0, nbytes // 4096, n)):
            t = time.perf_counter_ns()
            os.preadv(fd, [page], int(blk) * 4096)
            lat[i] = time.perf_counter_ns() - t
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    p50, p99 = _pcts(lat)
    return {"disk_read_4k_p50_us": p50, "disk_read_4k_p99_us": p99}


class Swapfile:
    """A swapfile on the local disk, on for the swap baseline only."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.path = directory / "dlshare-bench.swap"
        self.nbytes = nbytes
        self.on = False

    def __enter__(self) -> "Swapfile":
        try:
            subprocess.run(["fallocate", "-l", str(self.nbytes), str(self.path)], check=True, capture_output=True)
            os.chmod(self.path, 0o600)
            subprocess.run(["mkswap", str(self.path)], check=True, capture_output=True)
            subprocess.run(["swapon", str(self.path)], check=True, capture_output=True, text=True)
            self.on = True
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            err = getattr(exc, "stderr", b"") or b""
            raise RuntimeError(f"swap refused: {(err.decode() if isinstance(err, bytes) else err).strip() or exc}") \
                from None
        return self

    def close(self) -> None:
        if self.on:
            subprocess.run(["swapoff", str(self.path)], capture_output=True)
            self.on = False
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.close()


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
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev = msg.pop("event", None)
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
    if "samples_per_s" not in out and "gbps" not in out and "fault" not in out and "lost_bytes" not in out:
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

def run(args) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    ws = int(getattr(args, "working_set", 0) or (256 * MIB if quick else GIB))
    dlrm_args = ["--steps", "30" if quick else "80", "--warmup", "5", "--batch", "1024"]
    scan_args = ["--passes", "2" if quick else "4"]
    units = [4 << 10, 16 << 10, 64 << 10] if quick else [4 << 10, 16 << 10, 64 << 10, 256 << 10]
    policies = ["clock", "fifo"] if quick else ["clock", "fifo", "random"]
    notes: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    budget = ["--max-seconds", "20" if quick else "60"]  # a slow baseline (memmap) ends its timed part early
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dlshare-bench-paging-", dir="/var/tmp"))
    restore = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in restore:  # a kill of the bench still tears the swapfile and the cgroups down
        signal.signal(s, _stop_bench)
    echo = EchoBaseline()
    cluster = Cluster(3, 64 * MIB, tmp)
    region = ["--broker", cluster.url]
    try:
        def go(key: str, workload: str, mode: str, share: float | None, extra: list[str], **kw) -> None:
            t = time.perf_counter()
            runs[key] = r = run_program(workload, mode, share, ws, tmp, extra + budget, **kw)
            if r.get("error") and kw.get("swap") and r.get("cgroup", {}).get("oom_kills"):
                # v1 charges swap-in readahead (the swap cache) to the group: a tight limit can OOM the
                # swap baseline where it would only be slow; give it another margin, and say so
                notes.append(f"{key}: OOM-killed at {r['limit_bytes'] >> 20} MiB during swap-in; rerun with "
                             f"{MARGIN >> 20} MiB more")
                runs[key] = r = run_program(workload, mode, share, ws, tmp, extra + budget, margin=2 * MARGIN, **kw)
            r["wall_s"] = time.perf_counter() - t
            print(f"  {key}: {_value(r) or r.get('error') or ''} ({r['wall_s']:.0f} s)", flush=True)

        for wl, wargs in (("dlrm", dlrm_args), ("scan", scan_args)):
            go(f"{wl}_local", wl, "local", None, wargs)
            go(f"{wl}_region50", wl, "region", 0.5, wargs + region)
            go(f"{wl}_region25", wl, "region", 0.25, wargs + region)
            go(f"{wl}_memmap50", wl, "memmap", 0.5, wargs)
        for wl, wargs in (("dlrm", dlrm_args), ("scan", scan_args)) if not quick else (("dlrm", dlrm_args),):
            for u in units:
                if u != DEFAULT_UNIT:
                    go(f"{wl}_region50_unit{u >> 10}k", wl, "region", 0.5, wargs + region + ["--unit", str(u)])
            for pol in policies:
                if pol != "clock":
                    go(f"{wl}_region50_{pol}", wl, "region", 0.5, wargs + region + ["--policy", pol])
        raw = echo.measure(2000)
        try:
            disk = disk_read_latency(tmp)
        except OSError as exc:
            disk = {}
            notes.append(f"disk read latency not measured: {exc}")
        go("latency", "latency", "region", None, region + ["--units", "4096", str(64 << 10),
                                                           "--samples", "400" if quick else "2000"])
        raw = np.concatenate([raw, echo.measure(2000)])

        def killer(ev, msg, proc) -> None:
            if ev == "running":
                victim = next(iter(cluster.procs))
                cluster.kill9(victim)
                runs.setdefault("_kill", {})["victim"] = victim
                proc.stdin.write("killed\n")
                proc.stdin.flush()

        go("kill", "kill", "region", 0.25, region + ["--unit", str(DEFAULT_UNIT)], on_line=killer)
        try:
            with Swapfile(tmp, int(ws * 1.5) + 256 * MIB):
                for wl, wargs in (("dlrm", dlrm_args), ("scan", scan_args)):
                    go(f"{wl}_swap50", wl, "local", 0.5, wargs, swap=True)
                    if not quick:
                        go(f"{wl}_swap25", wl, "local", 0.25, wargs, swap=True)
            swap_reason = None
        except RuntimeError as exc:
            swap_reason = str(exc)
            notes.append(f"disk swap baseline unavailable: {swap_reason}")
    finally:
        cluster.close()
        echo.close()
        for s, h in restore.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)

    lat = runs["latency"].get("fault", {})
    m: dict[str, Any] = {
        "working_set_bytes": ws,
        "dlrm_local50_vs_local": _ratio(runs["dlrm_region50"], runs["dlrm_local"]),
        "dlrm_local50_vs_swap": _ratio(runs["dlrm_region50"], runs.get("dlrm_swap50")),
        "dlrm_local25_vs_local": _ratio(runs["dlrm_region25"], runs["dlrm_local"]),
        "scan_local50_vs_local": _ratio(runs["scan_region50"], runs["scan_local"]),
        "scan_local50_vs_swap": _ratio(runs["scan_region50"], runs.get("scan_swap50")),
        "dlrm_local50_vs_memmap": _ratio(runs["dlrm_region50"], runs["dlrm_memmap50"]),
        "scan_local50_vs_memmap": _ratio(runs["scan_region50"], runs["scan_memmap50"]),
        "scan_local25_vs_local": _ratio(runs["scan_region25"], runs["scan_local"]),
        "fault_unit_p50_us": lat.get(str(DEFAULT_UNIT), {}).get("p50_us"),
        "fault_unit_p99_us": lat.get(str(DEFAULT_UNIT), {}).get("p99_us"),
        "fault_4k_p50_us": lat.get("4096", {}).get("p50_us"),
        "fault_4k_p99_us": lat.get("4096", {}).get("p99_us"),
        "fault_64k_p50_us": lat.get(str(64 << 10), {}).get("p50_us"),
        "fault_64k_p99_us": lat.get(str(64 << 10), {}).get("p99_us"),
        "donor_kill_lost_bytes": runs["kill"].get("lost_bytes"),
        "swap_available": swap_reason is None,
        "unit_bytes": DEFAULT_UNIT,
    }
    m["raw_socket_rtt_p50_us"], m["raw_socket_rtt_p99_us"] = _pcts(raw)
    m.update(disk)
    for k, r in runs.items():
        if not k.startswith("_") and _value(r) is not None:
            m[f"{k}_{'samples_per_s' if 'samples_per_s' in r else 'gbps'}"] = _value(r)
    sweep = {wl: {"unit": {str(u): _value(runs.get(f"{wl}_region50" if u == DEFAULT_UNIT else
                                                      f"{wl}_region50_unit{u >> 10}k", {}) or {})
                           for u in units},
                  "policy": {p: _value(runs.get(f"{wl}_region50" if p == "clock" else f"{wl}_region50_{p}", {}) or {})
                             for p in policies}}
             for wl in ("dlrm", "scan")}
    for k, r in runs.items():
        if r.get("error"):
            notes.append(f"{k}: {r['error']}")
    targets = report.target_rows([
        ("dlrm_local50_vs_local >= 0.6", m["dlrm_local50_vs_local"], ">=", 0.6),
        ("dlrm_local50_vs_swap >= 3", m["dlrm_local50_vs_swap"], ">=", 3.0),
        ("dlrm_local25_vs_local >= 0.4", m["dlrm_local25_vs_local"], ">=", 0.4),
        ("scan_local50_vs_local >= 0.5", m["scan_local50_vs_local"], ">=", 0.5),
        ("donor_kill_lost_bytes == 0", m["donor_kill_lost_bytes"], "==", 0),
    ])
    m["bench_s"] = time.perf_counter() - t_start
    result = report.envelope("paging", m, targets=targets, sweep=sweep, runs=runs, notes=notes, quick=quick,
                             swap_unavailable_reason=swap_reason)
    _print(result)
    _plot(result, getattr(args, "json", None))
    return result


def _print(result: dict[str, Any]) -> None:
    m, runs = result["metrics"], result["runs"]
    rows = []
    for k, r in runs.items():
        if k.startswith("_") or _value(r) is None:
            continue
        rows.append({"run": k, "value": round(_value(r), 3), "unit": "samples/s" if "samples_per_s" in r else "GB/s",
                     "limit MiB": round(r["limit_bytes"] / MIB) if r.get("limit_bytes") else "-",
                     "peak MiB": round(r.get("cgroup", {}).get("max_usage_bytes", 0) / MIB) or "-"})
    print(f"\n## paging ({'quick' if result['quick'] else 'full'}, working set {m['working_set_bytes'] // MIB} MiB)\n")
    print(report.markdown_table(rows, ["run", "value", "unit", "limit MiB", "peak MiB"]))
    lat = [{"measure": k, "value": m.get(k)} for k in ("fault_4k_p50_us", "fault_4k_p99_us", "fault_64k_p50_us",
                                                   "fault_64k_p99_us", "fault_unit_p50_us",
                                                   "fault_unit_p99_us", "raw_socket_rtt_p50_us",
                                                   "raw_socket_rtt_p99_us", "disk_read_4k_p50_us",
                                                   "disk_read_4k_p99_us", "donor_kill_lost_bytes")]
    print(report.markdown_table(lat, ["measure", "value"]))
    for wl, s in result["sweep"].items():
        print(f"sweep {wl}: units {s['unit']}, policies {s['policy']}")
    print(report.markdown_table(result["targets"]))
    for n in result["notes"]:
        print(f"note: {n}")


def _plot(result: dict[str, Any], json_path: str | None) -> None:
    plt = report.pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, wl, unit in ((axes[0], "dlrm", "samples/s"), (axes[1], "scan", "GB/s")):
        names = [("local", "all local"), ("region50", "region 50%"), ("region25", "region 25%"),
                 ("swap50", "disk swap 50%"), ("memmap50", "memmap 50%")]
        base = _value(runs.get(f"{wl}_local", {}) or {}) or 1.0
        labels, vals = [], []
        for key, label in names:
            v = _value(runs.get(f"{wl}_{key}", {}) or {})
            labels.append(label)
            vals.append(v / base if v else 0.0)
        bars = ax.bar(labels, vals, color=["#888", "#1f77b4", "#6baed6", "#d62728", "#ff9896"])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}" if v else "n/a", ha="center", va="bottom")
        ax.set_title(f"{wl}: throughput vs all local ({base:.3g} {unit})")
        ax.set_ylabel("fraction of all-local throughput")
        ax.tick_params(axis="x", rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"dlshare paging, working set {result['metrics']['working_set_bytes'] // MIB} MiB, "
                 "local memory capped by a cgroup limit")
    out = report.out_dir(json_path) / "paging_throughput.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
