"""``dlshare bench paging-bound``: how fast the DLRM workload of ``dlshare bench paging`` could run at a
local share on this machine, whatever the region engine does, against how fast it runs.

Each round (2 quick, 3 full), interleaved: the program all-local, with its table in a region at 50%
and at 25% local (bench/paging_work.py's ``dlrm``, 100 timed steps of 1,024 samples), then the data
plane alone carrying each region run's traffic.  Per training step:

- **compute**: the all-local step's wall time and CPU;
- **traffic**: the units the region fetched and wrote back (to 2 copies) in its timed part;
- **the data plane's CPU for that traffic**: the same numbers of scattered 4 KiB reads and 2-copy
  writes, per step, through ``RemoteBuffer.read_pages`` / ``write_pages`` on the same donors, with no
  faults, installs or evictions (program and donors' CPU);
- **the cache**: misses a step for the workload's law (Zipf(1.05) rows hashed over the table, 8
  lookups a sample, independent draws) at the share's capacity, simulated under LRU, under the engine's
  CLOCK as the workload's hints drive it (GCLOCK, references capped at 3), under an LFU that counts
  every unit's references since the start (the most an online policy can learn of the law), and under
  A0 (the most popular units held, knowing the law: for independent draws no policy misses less on
  average).  The gaps say what a better replacement policy could still win.

Also, when the machine has 2 CPUs or more, the 50% run once more with the program on CPU 0 and the
donors on the others (``pinned50``): the program then never needs another CPU to flush its TLB when the
engine write-protects or drops a unit, so the program's CPU a step against the unpinned run's is what
those cross-CPU flushes (IPIs) cost.

A step can be no shorter than its compute, nor than the compute's CPU plus the data plane's CPU for
its traffic spread over every CPU of the machine.  ``bound_ratio_*`` is the all-local step over that
floor, at the traffic the engine caused, at LRU's and at A0's (the data plane's CPU scaled by units):
the best ``dlrm_local*_vs_local`` a zero-overhead engine could reach here.  It leaves out what the
engine must add (faults, installs, evictions, write-protection), so the engine's own figure is below it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import report
from bench.memory import Cluster
from bench.paging import MIB, median_range, run_program
from bench.paging_work import DIM, HASH_ADD, HASH_MUL, LOOKUPS, ZIPF_S

UNIT = 4096
BATCH = 1024
SHARES = (0.5, 0.25)


# --- the cache, from the workload's law ------------------------------------------------------------

def unit_probabilities(rows: int, unit: int = UNIT, s: float = ZIPF_S) -> np.ndarray:
    """P(a lookup reads unit u), exactly, for paging_work.zipf_rows: rank k is drawn when the inverted
    power law lands in [k + 1, k + 2) (the last rank takes the rest), then hashed to its row."""
    a = 1.0 - s
    edges = np.arange(1, rows + 2, dtype=np.float64)
    cdf = (edges ** a - 1.0) / ((rows + 1.0) ** a - 1.0)
    p_rank = np.diff(cdf)
    p_rank[-1] += 1.0 - cdf[-1]
    row = (np.arange(rows, dtype=np.int64) * HASH_MUL + HASH_ADD) % rows
    per_unit = unit // (DIM * 4)
    return np.bincount(row // per_unit, weights=p_rank, minlength=-(-rows // per_unit))


def a0_misses_per_step(p: np.ndarray, capacity: int, lookups: int) -> tuple[float, float]:
    """(expected distinct units a step reads, expected misses a step with the ``capacity`` most popular
    units held), for ``lookups`` independent draws a step."""
    seen = -np.expm1(lookups * np.log1p(-np.minimum(p, 1 - 1e-15)))  # P(u is read in a step)
    order = np.argsort(-p, kind="stable")
    return float(seen.sum()), float(seen[order[capacity:]].sum())


def _draws(p: np.ndarray, lookups: int, steps: int, seed: int):
    """Each step's distinct units, ``lookups`` independent draws from ``p`` a step."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    for _ in range(steps):
        yield np.unique(np.searchsorted(cdf, rng.random(lookups), side="right"))


def lru_misses_per_step(p: np.ndarray, capacity: int, lookups: int, steps: int, warm: int,
                        seed: int = 7) -> float:
    """Mean misses a step of an LRU cache of ``capacity`` units over ``warm + steps`` steps of draws
    from ``p`` (each step's distinct units referenced once, as the engine's prefetch does)."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for k, units in enumerate(_draws(p, lookups, warm + steps, seed)):
        for u in units.tolist():
            if u in cache:
                cache.move_to_end(u)
                continue
            misses += k >= warm
            cache[u] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return misses / steps


def gclock_misses_per_step(p: np.ndarray, capacity: int, lookups: int, steps: int, warm: int,
                           ref_max: int = 3, seed: int = 7) -> float:
    """Mean misses a step of the engine's CLOCK as the workload's hints drive it (GCLOCK): units in a
    ring in the order they came in; each step's resident units gain a reference (at most ``ref_max``,
    the engine's cap); the hand passes a referenced unit on with one reference less and evicts the
    first unit with none."""
    ring: deque[int] = deque()
    ref: dict[int, int] = {}
    misses = 0
    for k, units in enumerate(_draws(p, lookups, warm + steps, seed)):
        for u in units.tolist():
            if u in ref:
                ref[u] = min(ref[u] + 1, ref_max)
                continue
            misses += k >= warm
            ref[u] = 0
            ring.append(u)
        while len(ref) > capacity:
            u = ring.popleft()
            if ref[u]:
                ref[u] -= 1
                ring.append(u)
            else:
                del ref[u]
    return misses / steps


def lfu_misses_per_step(p: np.ndarray, capacity: int, lookups: int, steps: int, warm: int,
                        seed: int = 7) -> float:
    """Mean misses a step of an LFU cache that counts every unit's references since the start,
    resident or not (the most an online policy can learn of the law): a miss is always taken in, and
    the resident units counted least leave, never one the step reads."""
    count = np.zeros(len(p))
    resident = np.zeros(len(p), dtype=bool)
    held, misses = 0, 0
    for k, units in enumerate(_draws(p, lookups, warm + steps, seed)):
        count[units] += 1
        new = units[~resident[units]]
        misses += len(new) * (k >= warm)
        resident[new] = True
        held += len(new)
        if held > capacity:
            candidates = np.flatnonzero(resident)
            candidates = candidates[~np.isin(candidates, units)]
            out = candidates[np.argsort(count[candidates], kind="stable")[:held - capacity]]
            resident[out] = False
            held -= len(out)
    return misses / steps


def floor_step_ms(compute_ms: float, compute_cpu_ms: float, plane_cpu_ms: float, cpus: int) -> float:
    """The shortest a step can be: its compute, or all the CPU it needs spread over every CPU."""
    return max(compute_ms, (compute_cpu_ms + plane_cpu_ms) / cpus)


# --- measured parts --------------------------------------------------------------------------------

def replay(mem, fetch: int, write: int, steps: int, cluster: Cluster, seed: int) -> dict[str, float]:
    """``steps`` steps of ``fetch`` scattered page reads and ``write`` scattered 2-copy page writes on a
    fresh buffer of the donors; per step: wall and CPU (this process, the donors) in ms."""
    buf = mem.alloc(256 * MIB)
    try:
        n = buf.nbytes // buf.page
        zeros = np.zeros(1024 * buf.page, np.uint8)
        for c in range(0, n, 1024):  # every page written once, as the region's were
            k = min(1024, n - c)
            buf.write_pages(np.arange(c, c + k), zeros[:k * buf.page])
        rng = np.random.default_rng(seed)
        out = np.empty(max(fetch, 1) * buf.page, np.uint8)
        data = np.ones(max(write, 1) * buf.page, np.uint8)
        me = psutil.Process()
        t, c0, d0 = time.perf_counter(), sum(me.cpu_times()[:2]), cluster.cpu_s()
        for _ in range(steps):
            if fetch:
                buf.read_pages(np.sort(rng.choice(n, fetch, replace=False)), out)
            if write:
                buf.write_pages(np.sort(rng.choice(n, write, replace=False)), data)
        wall = time.perf_counter() - t
        return {"wall_ms": 1e3 * wall / steps, "program_cpu_ms": 1e3 * (sum(me.cpu_times()[:2]) - c0) / steps,
                "donors_cpu_ms": 1e3 * (cluster.cpu_s() - d0) / steps}
    finally:
        buf.free()


ENGINE_STAGES = ("fault", "fetch", "install", "reserve_wait", "evict")


def dlrm_run(share: float | None, ws: int, tmp: Path, cluster: Cluster, steps: int) -> dict[str, Any]:
    marks: dict[str, float] = {}

    def phases(ev, msg, proc) -> None:
        if ev == "phase":
            marks[msg["name"]] = cluster.cpu_s()

    mode = "local" if share is None else "region"
    args = ["--steps", str(steps), "--warmup", "5", "--batch", str(BATCH), "--max-seconds", "60",
            "--broker", cluster.url]
    r = run_program("dlrm", mode, share, ws, tmp, args, on_line=phases)
    if r.get("error"):
        return r
    n = r["steps_timed"]
    ts = r.get("timed_stats", {})
    return {"step_ms": r["step_ms"], "program_cpu_ms": 1e3 * r["timed_program_cpu_s"] / n,
            "donors_cpu_ms": 1e3 * (marks.get("end", 0.0) - marks.get("timed", 0.0)) / n,
            "fetched_per_step": ts.get("fetched_units", 0) / n,
            "written_per_step": ts.get("written_back_units", 0) / n,  # units (each to 2 copies)
            # where the engine's threads spent the timed steps (summed over threads, so not wall time)
            **{f"{k}_ms_per_step": ts.get(f"{k}_ns", 0) / 1e6 / n for k in ENGINE_STAGES},
            "samples_per_s": r["samples_per_s"]}


class Pinned:
    """The program (this thread's children) on CPU 0 and every donor thread on the other CPUs, until exit."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.all = os.sched_getaffinity(0)

    def _donor_threads(self) -> list[int]:
        tids = []
        for proc in self.cluster.procs.values():
            try:
                tids += [t.id for t in psutil.Process(proc.pid).threads()]
            except psutil.Error:
                pass
        return tids

    def _pin(self, own: set[int], donors: set[int]) -> None:
        os.sched_setaffinity(0, own)
        for tid in self._donor_threads():
            try:
                os.sched_setaffinity(tid, donors)
            except OSError:  # a thread that has just ended
                pass

    def __enter__(self) -> "Pinned":
        first = min(self.all)
        self._pin({first}, self.all - {first})
        return self

    def __exit__(self, *exc) -> None:
        self._pin(self.all, self.all)


def run(args) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    ws = int(getattr(args, "working_set", 0) or 256 * MIB)
    rounds = 2 if quick else 3
    steps = 100
    cpus = len(os.sched_getaffinity(0))
    notes: list[str] = []
    load0 = os.getloadavg()[0]
    if load0 >= 0.5:
        notes.append(f"load average {load0:.2f} at the start (>= 0.5): do not record these figures")
        print(f"WARNING: {notes[-1]}", flush=True)
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="dlshare-bench-bound-", dir="/var/tmp"))
    cluster = Cluster(3, 64 * MIB, tmp)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        from rdma import RemoteMemory

        mem = RemoteMemory(cluster.url, replicas=2, discover_timeout_s=30)
        try:
            deadline = time.monotonic() + 30
            while len(mem.donors()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            for rnd in range(rounds):
                for share in (None, *SHARES):
                    key = "local" if share is None else f"region{int(share * 100)}"
                    r = dlrm_run(share, ws, tmp, cluster, steps)
                    r["round"], r["load_start"] = rnd, os.getloadavg()[0]
                    runs.setdefault(key, []).append(r)
                    print(f"  round {rnd} {key}: {r.get('step_ms', r.get('error'))} ms a step", flush=True)
                if cpus >= 2:
                    with Pinned(cluster):
                        r = dlrm_run(0.5, ws, tmp, cluster, steps)
                    r["round"], r["load_start"] = rnd, os.getloadavg()[0]
                    runs.setdefault("pinned50", []).append(r)
                    print(f"  round {rnd} region50, program on one CPU: {r.get('step_ms', r.get('error'))} ms a step",
                          flush=True)
                for share in SHARES:
                    r = runs[f"region{int(share * 100)}"][-1]
                    if r.get("error"):
                        continue
                    p = replay(mem, round(r["fetched_per_step"]), round(r["written_per_step"]), 30, cluster,
                               seed=rnd)
                    p["round"] = rnd
                    runs.setdefault(f"plane{int(share * 100)}", []).append(p)
        finally:
            mem.close()
    finally:
        cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    notes += [f"{k} round {r.get('round')}: {r['error']}" for k, rs in runs.items() for r in rs if r.get("error")]
    m = _metrics(runs, ws, cpus, quick)
    m["bench_s"] = time.perf_counter() - t_start
    result = report.envelope("paging-bound", m, runs=runs, notes=notes, quick=quick, cpus=cpus)
    _print(m)
    return result


def _med(rs: list[dict[str, Any]], key: str) -> float | None:
    return median_range([r.get(key) for r in rs if r.get(key) is not None])[0]


def _metrics(runs: dict[str, list[dict[str, Any]]], ws: int, cpus: int, quick: bool) -> dict[str, Any]:
    rows = ws // (DIM * 4)
    p = unit_probabilities(rows)
    lookups = BATCH * LOOKUPS
    m: dict[str, Any] = {"working_set_bytes": ws, "cpus": cpus}
    local = runs.get("local", [])
    compute_ms, compute_cpu = _med(local, "step_ms"), _med(local, "program_cpu_ms")
    m["local_step_ms"], m["local_cpu_ms"] = compute_ms, compute_cpu
    for share in SHARES:
        tag = str(int(share * 100))
        reg, plane = runs.get(f"region{tag}", []), runs.get(f"plane{tag}", [])
        cap = int(share * ws) // UNIT
        distinct, a0 = a0_misses_per_step(p, cap, lookups)
        warm = 4 * cap // max(1, int(distinct)) + 20  # the cache filled and turned over 3 times
        sim_steps = 60 if quick else 150
        lru = lru_misses_per_step(p, cap, lookups, steps=sim_steps, warm=warm)
        gclock = gclock_misses_per_step(p, cap, lookups, steps=sim_steps, warm=warm)
        lfu = lfu_misses_per_step(p, cap, lookups, steps=sim_steps, warm=warm)
        fetched = _med(reg, "fetched_per_step")
        plane_cpu = median_range([x["program_cpu_ms"] + x["donors_cpu_ms"] for x in plane])[0]
        m[f"local{tag}_distinct_units_per_step"] = distinct
        m[f"local{tag}_misses_per_step"] = {"engine": fetched, "lru": lru, "gclock": gclock, "lfu": lfu, "a0": a0}
        m[f"local{tag}_step_ms"] = _med(reg, "step_ms")
        m[f"local{tag}_cpu_ms"] = {"program": _med(reg, "program_cpu_ms"), "donors": _med(reg, "donors_cpu_ms"),
                                   "dataplane_same_traffic": plane_cpu}
        m[f"local{tag}_engine_ms_per_step"] = {k: _med(reg, f"{k}_ms_per_step") for k in ENGINE_STAGES}
        m[f"dlrm_local{tag}_vs_local"] = (compute_ms / m[f"local{tag}_step_ms"]
                                          if compute_ms and m[f"local{tag}_step_ms"] else None)
        bounds = {}
        for name, misses in (("engine", fetched), ("lru", lru), ("gclock", gclock), ("lfu", lfu), ("a0", a0)):
            if None in (compute_ms, compute_cpu, plane_cpu, fetched) or not fetched:
                bounds[name] = None
                continue
            floor = floor_step_ms(compute_ms, compute_cpu, plane_cpu * misses / fetched, cpus)
            bounds[name] = compute_ms / floor
        m[f"bound_ratio_local{tag}"] = bounds
    pinned = runs.get("pinned50", [])
    m["local50_pinned"] = {"step_ms": _med(pinned, "step_ms"), "program_cpu_ms": _med(pinned, "program_cpu_ms"),
                           "donors_cpu_ms": _med(pinned, "donors_cpu_ms")} if pinned else None
    return m


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _print(m: dict[str, Any]) -> None:
    """The table; a part whose runs all failed shows "-" (the notes and the JSON say why)."""
    print(f"all-local: {_f(m['local_step_ms'])} ms a step ({_f(m['local_cpu_ms'])} ms CPU); {m['cpus']} CPUs")
    print(f"{'share':>6} {'step ms':>8} {'prog CPU':>9} {'donors':>7} {'plane CPU':>10} "
          f"{'misses engine/LRU/GCLOCK/LFU/A0':>32} {'ratio':>6} {'bound engine/LRU/GCLOCK/LFU/A0':>32}")
    for share in SHARES:
        tag = str(int(share * 100))
        c, mi, b = m[f"local{tag}_cpu_ms"], m[f"local{tag}_misses_per_step"], m[f"bound_ratio_local{tag}"]
        misses = "/".join(_f(mi[k], 0) for k in ("engine", "lru", "gclock", "lfu", "a0"))
        bound = "/".join(_f(b[k]) for k in ("engine", "lru", "gclock", "lfu", "a0"))
        print(f"{tag + '%':>6} {_f(m[f'local{tag}_step_ms']):>8} {_f(c['program']):>9} {_f(c['donors']):>7} "
              f"{_f(c['dataplane_same_traffic']):>10} {misses:>32} {_f(m[f'dlrm_local{tag}_vs_local']):>6} {bound:>32}")
    for share in SHARES:
        tag = str(int(share * 100))
        st = m.get(f"local{tag}_engine_ms_per_step") or {}
        print(f"{tag}%: engine threads' ms a step (summed over threads): "
              + ", ".join(f"{k} {_f(st.get(k))}" for k in ENGINE_STAGES))
    pin = m.get("local50_pinned")
    if pin and pin["step_ms"] is not None:
        print(f"50%, the program on one CPU and the donors on the others: {_f(pin['step_ms'])} ms a step, program "
              f"{_f(pin['program_cpu_ms'])} ms CPU (unpinned {_f(m['local50_cpu_ms']['program'])}), donors "
              f"{_f(pin['donors_cpu_ms'])}")
