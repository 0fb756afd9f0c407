"""``dlshare bench cache``: a real PyTorch input pipeline with its sample cache local, on donors, or absent.

The run writes a synthetic ImageNet-like dataset as JPEG files (PIL, ~100 kB each), then trains on it
(bench/cache_work.py: decode and resize in 2 DataLoader workers, a fixed time per sample standing in
for the GPU step), each variant in its own process under a real cgroup (v1) memory limit: its own
footprint before any cache, plus the local cache it is given, plus a margin.

- (a) ``none``: no cache (every epoch decodes every JPEG; the margin's page cache is all it keeps);
- (b) ``local``: a local-only cache holding 25% of the decoded dataset (a memory-short node);
- (c) ``lent``: the same 25% local, and a named cache on donors (2 copies) holding every sample;
- (d) ``all_local``: the whole decoded dataset cached locally (the bound);
- (e) ``attach``: a second job attaching read-only to the cache (c) filled, while (c) still runs.

Variants run interleaved, (a) (b) (c)+(e) (d), for ``rounds`` rounds; epoch 0 fills, later epochs
hit.  Reported per variant: samples/s per epoch and the hit rates (median and range over rounds);
ratios of later-epoch medians; the load average at the start and end of each variant (a warning
when it is above 0.5 at the start).  JSON is rewritten after every round.

From (c) the bench measures what the remote tier delivers (a 4 KiB read's p50 at the slab server, one
sample read's p50, the read rate of 2 readers) and a region's streaming rate, writes them as the calibration of the scheduler's
:class:`~scheduler.remote_memory.RemoteLink` (``remote_link.json`` beside the JSON), predicts (c)'s
speed from (b) and (d) with that link (:func:`scheduler.remote_memory.predicted_speed`), and runs the
memory-short scheduling benchmark (bench/sched_memory.py) with the calibrated link.  A last run
kills a donor with SIGKILL half way through an epoch and counts samples that differ from the
uncached pipeline.
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
from bench.memory import Cluster
from bench.paging_host import MemoryLimit

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
MARGIN = 320 * MIB  # every variant: own footprint + its local cache + this (2 workers, batches, some page cache)
SECRET = "bench-cache-" + os.urandom(8).hex()
LOCAL_SHARE = 0.25
SLAB = 16 * MIB


def add_arguments(parser: argparse.ArgumentParser, seen: set[str]) -> None:
    if "--images" not in seen:
        parser.add_argument("--images", type=int, default=0, metavar="N",
                            help="cache bench: JPEG images in the dataset (default 600 quick, 2000 full)")
        seen.add("--images")
    if "--rounds" not in seen:
        parser.add_argument("--rounds", type=int, default=0, help="cache bench: rounds of the interleaved variants")
        seen.add("--rounds")


def write_dataset(root: Path, n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` JPEGs of 500x375, smooth colour fields with texture: ~100 kB each at quality 90, as ImageNet's."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:375, 0:500].astype(np.float32)
    sizes = []
    for i in range(n):
        base = np.stack([np.sin(xx / rng.uniform(8, 60) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(8, 60))
                         for _ in range(3)], -1)
        img = (base * 80 + 128 + rng.normal(0, 14, base.shape)).clip(0, 255).astype(np.uint8)
        path = root / f"{i:06d}.jpg"
        Image.fromarray(img).save(path, quality=90)
        sizes.append(path.stat().st_size)
    return {"images": n, "jpeg_bytes_mean": float(np.mean(sizes)), "jpeg_bytes_total": int(np.sum(sizes))}


class Job:
    """One cache_work process under its own memory limit, driven over its stdin/stdout."""

    running: list["Job"] = []  # killed and their groups removed if the bench stops early

    def __init__(self, variant: str, data: Path, local: int, extra: list[str], limit_local: int) -> None:
        self.variant = variant
        self.cg = MemoryLimit(f"cache-{variant}-{os.getpid()}-{time.monotonic_ns()}")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.cache_work", variant, "--dir", str(data), *extra],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=self.cg.join)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        self.out: dict[str, Any] = {"variant": variant, "epochs": [], "load_start": list(os.getloadavg())}
        self.local, self.limit_local = local, limit_local
        Job.running.append(self)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: finish() says how

    def until(self, stop_at: str | None = None, on=None) -> dict[str, Any]:
        """Read events until ``stop_at`` (or the end)."""
        for ev, msg in report.json_events(self.proc.stdout):
            if ev == "ready":
                self.out["base_charged"] = self.cg.usage()
                self.out["limit_bytes"] = self.out["base_charged"] + self.limit_local + MARGIN
                self.cg.limit(self.out["limit_bytes"], swap=False)
                self.send(f"go {self.local}")
            elif ev == "epoch":
                self.out["epochs"].append(msg)
            elif ev == "result":
                self.out.update(msg)
            elif on is not None:
                on(ev, msg)
            if ev == stop_at:
                return self.out
        return self.finish()

    def finish(self) -> dict[str, Any]:
        if self in Job.running:
            Job.running.remove(self)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.out["load_end"] = list(os.getloadavg())
        self.out["cgroup"] = self.cg.stats()
        self.cg.remove()
        if "rss" not in self.out:
            self.out["error"] = (f"exit {self.proc.returncode}"
                                 + (" (OOM-killed)" if self.out["cgroup"].get("oom_kills") else "") + ": "
                                 + "".join(self.err[-6:]).strip()[-600:])
        return self.out


def later(r: dict[str, Any], key: str = "samples_per_s") -> float | None:
    """Median over the epochs after the first (the ones that hit)."""
    eps = r.get("epochs", [])[1:]
    return float(np.median([e[key] for e in eps])) if eps else None


def first(r: dict[str, Any]) -> float | None:
    eps = r.get("epochs", [])
    return eps[0]["samples_per_s"] if eps else None


def region_stream_rate(url: str, nbytes: int, local: int) -> float | None:
    """Sequential read of a region twice the size of its resident share (bytes/s over the second pass)."""
    from rdma.remote import RemoteMemory

    with RemoteMemory(url, replicas=2, discover_timeout_s=20) as mem:
        with mem.map(nbytes, local_bytes=local) as region:
            a = region.array(np.uint8, (nbytes,))
            a[:] = 1
            region.flush()
            t = time.perf_counter()
            s = int(a[::4096].sum())  # one byte a page: every page fetched
            wall = time.perf_counter() - t
            return nbytes / wall if wall > 0 and s else None


def run(args) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    n = int(getattr(args, "images", 0) or (600 if quick else 2000))
    rounds = int(getattr(args, "rounds", 0) or (2 if quick else 3))
    epochs = 3 if quick else 4
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    notes: list[str] = []
    if load0[0] > 0.5:
        notes.append(f"load average {load0[0]:.2f} at the start (above 0.5): other work shares the machine")
        print(f"WARNING: load average {load0[0]:.2f} at the start; figures will be noisy", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="dlshare-bench-cache-", dir="/var/tmp"))
    restore = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in restore:
        signal.signal(s, _stop_bench)
    data = tmp / "jpeg"
    ds_info = write_dataset(data, n)
    sample_bytes = 3 * 224 * 224 + 64  # a decoded uint8 CHW sample and its codec header
    decoded = n * sample_bytes
    local = int(decoded * LOCAL_SHARE)
    remote = 2 * (decoded * 5 // 4 + 2 * SLAB)  # every sample on donors, 2 copies, the index, spare
    cluster = Cluster(3, SLAB, tmp)
    base = ["--epochs", str(epochs), "--workers", "2", "--batch", "32"]
    lent = base + ["--broker", cluster.url, "--remote-bytes", str(remote), "--secret", SECRET]
    rounds_out: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    try:
        from rdma.remote import RemoteMemory

        with RemoteMemory(cluster.url, replicas=2, discover_timeout_s=30):
            pass  # every donor is up before the first variant
        for rnd in range(rounds):
            rr: dict[str, Any] = {}
            seed = ["--seed", str(rnd)]
            rr["none"] = Job("none", data, 0, base + seed, local).until()
            rr["local"] = Job("local", data, local, base + seed, local).until()
            owner = Job("lent", data, local, lent + seed + ["--name", f"bench-{rnd}"], local)
            if owner.until("filled").get("error") is None:
                rr["attach"] = Job("attach", data, 0, lent + seed + ["--name", f"bench-{rnd}"], local).until()
            owner.send("done")
            rr["lent"] = owner.until()
            rr["all_local"] = Job("all_local", data, decoded + 16 * MIB, base + seed, decoded + 16 * MIB).until()
            for k, r in rr.items():
                print(f"  round {rnd} {k:9s} epochs {[round(e['samples_per_s']) for e in r.get('epochs', [])]} "
                      f"samples/s {r.get('error', '')}", flush=True)
            rounds_out.append(rr)
            result = _summarise(rounds_out, ds_info, sample_bytes, quick, notes, cluster, tmp, kill=None,
                                calib=None, memshort=None)
            report.write_json(result, getattr(args, "json", None))
        kill = Job("kill", data, 0, ["--epochs", "2", "--workers", "2", "--batch", "32", "--broker", cluster.url,
                                     "--remote-bytes", str(remote)], local)

        def killer(ev, msg) -> None:
            if ev == "mid":
                victim = next(iter(cluster.procs))
                cluster.kill9(victim)
                kill.send("killed")

        kill_out = kill.until(on=killer)
        try:
            region_rate = region_stream_rate(cluster.url, 64 * MIB if quick else 256 * MIB, 16 * MIB)
        except Exception as exc:  # noqa: BLE001 - reported, the rest of the bench stands
            region_rate = None
            notes.append(f"region streaming rate not measured: {exc}")
    finally:
        for job in list(Job.running):
            job.proc.kill()
            job.finish()
        cluster.close()
        for s, h in restore.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)
    calib = _calibrate(rounds_out, region_rate, getattr(args, "json", None))
    from bench.sched_memory import memshort

    print("  memshort with the calibrated link ...", flush=True)
    mem = memshort(link=calib["link_obj"])
    result = _summarise(rounds_out, ds_info, sample_bytes, quick, notes, None, None, kill=kill_out, calib=calib,
                        memshort=mem)
    result["metrics"]["bench_s"] = time.perf_counter() - t_start
    result["metrics"]["loadavg_start"], result["metrics"]["loadavg_end"] = list(load0), list(os.getloadavg())
    _print(result)
    _plot(result, getattr(args, "json", None))
    return result


def _stop_bench(signum, frame) -> None:
    raise SystemExit(f"bench stopped by signal {signum}")


def _calibrate(rounds_out: list[dict[str, Any]], region_rate: float | None, json_path: str | None) -> dict[str, Any]:
    from scheduler.remote_memory import RemoteLink

    reads = [r["lent"].get("remote_read") or {} for r in rounds_out]
    reads = [x for x in reads if x.get("read_bytes_per_s")]
    if not reads:
        return {"link_obj": RemoteLink(), "doc": None, "path": None}
    rate = float(np.median([x["read_bytes_per_s"] for x in reads]))
    p50 = float(np.median([x["sample_read_p50_s"] for x in reads]))
    per = float(np.median([x["sample_bytes"] for x in reads]))
    small = [x["read_4k_p50_s"] for x in reads if x.get("read_4k_p50_s")]
    # the fixed cost of one read: a 4 KiB read's p50 (as `bench memory` measured it), else what a
    # sample read takes beyond its bytes at the rate
    lat = float(np.median(small)) if small else max(0.0, p50 - per / rate)
    link = RemoteLink(read_bytes_per_s=rate, read_latency_s=lat, donor_bytes_per_s=rate,
                      region_bytes_per_s=region_rate or RemoteLink().region_bytes_per_s,
                      source=f"dlshare bench cache, {report.now_iso()}")
    doc = link.calibration(report.now_iso(), "dlshare bench cache", machine=report.machine(),
                           sample_bytes=per, sample_read_p50_s=p50, readers=reads[0].get("threads"),
                           region_measured=region_rate is not None)
    path = report.out_dir(json_path) / "remote_link.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return {"link_obj": link, "doc": doc, "path": str(path)}


def _summarise(rounds_out, ds_info, sample_bytes, quick, notes, cluster, tmp, kill, calib, memshort) -> dict[str, Any]:
    from scheduler.remote_memory import RemoteLink, efficiency, predicted_speed

    variants = ("none", "local", "lent", "all_local", "attach")
    table = []
    med: dict[str, dict[str, float | None]] = {}
    for v in variants:
        runs = [r[v] for r in rounds_out if v in r]
        lat = [later(r) for r in runs if later(r)]
        fst = [first(r) for r in runs if first(r)]
        hl = [later(r, "hit_local") for r in runs if r.get("epochs")]
        hr = [later(r, "hit_remote") for r in runs if r.get("epochs")]
        med[v] = {"later": float(np.median(lat)) if lat else None, "first": float(np.median(fst)) if fst else None,
                  "hit_local": float(np.median([x for x in hl if x is not None])) if any(x is not None for x in hl) else None,
                  "hit_remote": float(np.median([x for x in hr if x is not None])) if any(x is not None for x in hr) else None}
        table.append({"variant": v, "first epoch samples/s (median)": _r(med[v]["first"]),
                      "later epochs samples/s (median)": _r(med[v]["later"]),
                      "later range": f"{_r(min(lat))}-{_r(max(lat))}" if lat else "-",
                      "hit local": _r(med[v]["hit_local"], 3), "hit remote": _r(med[v]["hit_remote"], 3),
                      "load start/end": "; ".join(f"{r['load_start'][0]:.2f}/{r.get('load_end', [0])[0]:.2f}"
                                                  for r in runs),
                      "errors": "; ".join(r["error"][:80] for r in runs if r.get("error")) or "-"})

    def ratio(a, b):
        return a / b if a and b else None

    m: dict[str, Any] = {**ds_info, "decoded_sample_bytes": sample_bytes, "rounds": len(rounds_out),
                         "local_share": LOCAL_SHARE}
    m["cache_lent_vs_all_local"] = ratio(med["lent"]["later"], med["all_local"]["later"])
    m["cache_lent_vs_local_only"] = ratio(med["lent"]["later"], med["local"]["later"])
    m["cache_shared_first_epoch_vs_all_local"] = ratio(med["attach"]["first"], med["all_local"]["later"])
    m["cache_local_only_vs_none"] = ratio(med["local"]["later"], med["none"]["later"])
    if med["attach"]["later"] and med["all_local"]["later"]:
        # what a remote hit costs over a local one, per sample, in this run: (e) reads every sample from
        # the donors, (d) every sample locally; on one machine this includes the donors' CPU
        m["remote_hit_extra_s"] = 1.0 / med["attach"]["later"] - 1.0 / med["all_local"]["later"]
    for v in variants:
        m[f"{v}_later_samples_per_s"] = med[v]["later"]
        m[f"{v}_first_samples_per_s"] = med[v]["first"]
    if calib and calib["doc"] and med["local"]["later"] and med["all_local"]["later"] and med["lent"]["later"]:
        link: RemoteLink = calib["link_obj"]
        hb = med["local"]["hit_local"] or LOCAL_SHARE
        hc_local = med["lent"]["hit_local"] or LOCAL_SHARE
        demand = med["all_local"]["later"] * sample_bytes * (1.0 - hc_local)
        supply = min(link.read_bytes_per_s, link.stream_bytes_per_s(sample_bytes, 2))
        e = efficiency(demand, supply)
        pred = predicted_speed(med["local"]["later"], hb, med["all_local"]["later"], e)
        m.update(cache_model_efficiency=e, cache_model_demand_bytes_per_s=demand, cache_model_supply_bytes_per_s=supply,
                 cache_model_predicted_samples_per_s=pred,
                 cache_model_error=abs(pred - med["lent"]["later"]) / med["lent"]["later"],
                 # not the scheduler's model: the same link with each remote read's time on the path of a
                 # synchronous loader (2 workers, one sample in flight each), for which stage bounds (c)
                 cache_model_read_time_predicted_samples_per_s=1.0 / (
                     1.0 / med["all_local"]["later"]
                     + (1.0 - hc_local) * (link.read_latency_s + sample_bytes / link.read_bytes_per_s) / 2),
                 calibration=calib["doc"]["link"], calibration_path=calib["path"])
    if kill is not None:
        k = kill.get("kill") or {}
        m["cache_donor_kill_wrong_samples"] = k.get("wrong_samples") if not kill.get("error") else None
        m["cache_donor_kill_checked"] = k.get("checked")
        m["cache_donor_kill_lost"] = (k.get("cache") or {}).get("lost")
        if kill.get("error"):
            notes.append(f"kill run: {kill['error']}")
    if memshort is not None:
        m.update({k: v for k, v in memshort["metrics"].items()})
    readers = [r["lent"].get("readers") for r in rounds_out if r.get("lent", {}).get("readers")]
    targets = report.target_rows([
        ("cache_lent_vs_all_local >= 0.9", m["cache_lent_vs_all_local"], ">=", 0.9),
        ("cache_lent_vs_local_only >= 1.5", m["cache_lent_vs_local_only"], ">=", 1.5),
        ("cache_shared_first_epoch_vs_all_local >= 0.8", m["cache_shared_first_epoch_vs_all_local"], ">=", 0.8),
        ("cache_model_error <= 0.15", m.get("cache_model_error"), "<=", 0.15),
        ("cache_donor_kill_wrong_samples == 0", m.get("cache_donor_kill_wrong_samples"), "==", 0),
        ("memshort_recovered (calibrated link) >= 0.8", m.get("memshort_recovered"), ">=", 0.8),
    ])
    return report.envelope("cache", m, targets=targets, table=table, rounds=rounds_out, notes=notes, quick=quick,
                           readers=readers, memshort_rows=(memshort or {}).get("rows"))


def _r(v, nd: int = 1):
    return "-" if v is None else round(float(v), nd)


def _print(result: dict[str, Any]) -> None:
    m = result["metrics"]
    print(f"\n## cache ({'quick' if result['quick'] else 'full'}, {m['images']} JPEGs of "
          f"{m['jpeg_bytes_mean'] / 1e3:.0f} kB, {m['rounds']} rounds)\n")
    print(report.markdown_table(result["table"], list(result["table"][0])))
    rows = [{"measure": k, "value": _r(m.get(k), 4) if isinstance(m.get(k), (int, float)) else m.get(k)}
            for k in ("cache_lent_vs_all_local", "cache_lent_vs_local_only", "cache_shared_first_epoch_vs_all_local",
                      "cache_local_only_vs_none", "cache_model_efficiency", "cache_model_predicted_samples_per_s",
                      "lent_later_samples_per_s", "cache_model_error",
                      "cache_model_read_time_predicted_samples_per_s", "remote_hit_extra_s",
                      "cache_donor_kill_wrong_samples",
                      "cache_donor_kill_checked", "memshort_recovered", "memshort_lent_jct_h", "memshort_link")]
    print(report.markdown_table(rows, ["measure", "value"]))
    if m.get("calibration"):
        print(f"calibration ({m.get('calibration_path')}): {m['calibration']}")
    report.print_targets_and_notes(result)


def _plot(result: dict[str, Any], json_path: str | None) -> None:
    """samples/s per epoch of every variant (median over rounds, range as a band)."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"none": "(a) no cache", "local": "(b) 25% local", "lent": "(c) 25% local + donors",
              "all_local": "(d) all local", "attach": "(e) second job, attached"}
    for v, label in labels.items():
        runs = [r[v]["epochs"] for r in result["rounds"] if r.get(v, {}).get("epochs")]
        if not runs:
            continue
        n = min(len(e) for e in runs)
        a = np.array([[e[i]["samples_per_s"] for i in range(n)] for e in runs])
        x = np.arange(n)
        ax.plot(x, np.median(a, axis=0), marker="o", label=label)
        ax.fill_between(x, a.min(axis=0), a.max(axis=0), alpha=0.15)
    ax.set_xticks(np.arange(max(len(r[v]["epochs"]) for r in result["rounds"] for v in labels if r.get(v, {}).get("epochs"))))
    ax.set_xlabel("epoch (0 fills the cache)")
    ax.set_ylabel("samples/s")
    ax.set_title(f"dlshare bench cache: {result['metrics']['images']} JPEGs, 2 workers, load "
                 f"{result['metrics'].get('loadavg_start', [0])[0]:.1f} at the start")
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = report.out_dir(json_path) / "cache_epochs.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
