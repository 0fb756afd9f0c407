"""The programs ``dlshare bench paging`` runs, each in its own process under a cgroup memory limit.

    python -m bench.paging_work WORKLOAD --mode local|memmap|region [options]

The same code runs in every mode; only where the working set lives changes: ordinary memory
(``local``: also the swap baseline, the bench decides the limit and the swap), a ``np.memmap`` of a
file on the local disk (``memmap``), or a RemoteRegion on donors (``region``).

Protocol, one JSON object a line on stdout: ``{"event": "ready", "base_rss": B}`` once imports and
everything but the working set are in place; then the process reads ``go LOCAL_BYTES`` on stdin
(the bench has set the cgroup limit to B + the local share by then; a region keeps LOCAL_BYTES
resident) and ends with ``{"event": "result", ...}``.  ``kill`` also says ``running`` and waits for
``killed`` while it keeps working.

Workloads:
- ``dlrm``: a DLRM-style training loop: one embedding table the size of the working set (dim 64,
  fp32), 8 lookups a sample drawn from Zipf(1.05) over hashed row ids, sparse SGD, dense bottom and
  top MLPs; samples/s.  With ``--kill-mid-run`` it says ``running`` a third of the way in (the bench
  kills a donor then) and reports ``rebuild_s``, the seconds until the region was healthy again.
- ``scan``: shuffle-and-scan: every 4 MiB chunk of a float32 array the size of the working set, in a
  new random order each pass, summed; GB/s.
- ``stream``: region only: the scan's pattern on a region with almost nothing resident (every 4 MiB
  chunk once, in a random order, each in order), against ``RemoteBuffer.read_pages`` of the same
  chunks over the same donors (the data plane's batched read rate), passes interleaved; GB/s each.
- ``latency``: region only: touches of units that are not resident, one at a time, timed, with
  sequential prefetch off, for the unit sizes asked.
- ``kill``: region only: read-modify-write passes while the bench kills a donor; then every byte
  is checked against what the passes wrote (``lost_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import psutil

MIB = 1 << 20
DIM = 64
LOOKUPS = 8
DENSE = 13
CHUNK = 4 * MIB
ZIPF_S = 1.05  # the skew; DLRM traces are commonly fit with s around 1 (Criteo)
HASH_MUL, HASH_ADD = 2654435761, 97  # a prime multiplier: rank -> row is a bijection, hot rows spread out


def say(**obj) -> None:
    print(json.dumps(obj), flush=True)


def rss() -> int:
    return psutil.Process().memory_info().rss


def zipf_rows(rng: np.random.Generator, n_rows: int, size, s: float = ZIPF_S) -> np.ndarray:
    """Bounded Zipf(s) ranks by inverting the continuous power law on [1, n+1), then hashed to rows."""
    u = rng.random(size)
    a = 1.0 - s
    x = (1.0 + u * ((n_rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    rank = np.minimum(x.astype(np.int64) - 1, n_rows - 1)
    return (rank * HASH_MUL + HASH_ADD) % n_rows


class Place:
    """Where the working set lives for this run."""

    def __init__(self, args) -> None:
        self.args = args
        self.region = None
        self.mem = None
        if args.mode == "region":
            from rdma import RemoteMemory

            self.mem = RemoteMemory(args.broker, replicas=2, discover_timeout_s=30,
                                    rebuild_bytes_per_s=args.rebuild_bytes_per_s)
            deadline = time.monotonic() + 30
            while len(self.mem.donors()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)

    def map(self, nbytes: int, local: int):
        a = self.args
        self.region = self.mem.map(nbytes, local_bytes=local, unit=a.unit, policy=a.policy,
                                   prefetch_bytes=a.prefetch_bytes, fetch_workers=a.workers)
        return self.region

    def array(self, nbytes: int, local: int, dtype=np.float32) -> np.ndarray:
        n = nbytes // np.dtype(dtype).itemsize
        if self.args.mode == "local":
            return np.empty(n, dtype)
        if self.args.mode == "memmap":
            return np.memmap(os.path.join(self.args.dir, "working-set.bin"), dtype=dtype, mode="w+", shape=(n,))
        return self.map(nbytes, local).array(dtype, (n,))

    def stats(self) -> dict:
        return self.region.stats() if self.region is not None else {}

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
        if self.mem is not None:
            self.mem.close()


_CPU_AT_GO: list[float] = []


def cpu_s() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def wait_go() -> int:
    line = sys.stdin.readline().split()
    if not line or line[0] != "go":
        raise SystemExit("no go from the bench")
    _CPU_AT_GO.append(cpu_s())
    return int(line[1])


# --- workloads -------------------------------------------------------------------------------------

def dlrm(args, place: Place) -> dict:
    import torch

    from rdma.torch import place_embeddings, prefetch_lookups

    torch.set_num_threads(1)  # the same in every mode; the machine has 2 cores for the program, the engine and donors
    torch.manual_seed(0)
    rows = args.ws // (DIM * 4)

    class DLRM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True, device="meta")
            self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, 128), torch.nn.ReLU(),
                                              torch.nn.Linear(128, DIM), torch.nn.ReLU())
            self.top = torch.nn.Sequential(torch.nn.Linear(2 * DIM, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))

        def forward(self, dense, idx):
            return self.top(torch.cat([self.bottom(dense), self.emb(idx)], dim=1)).squeeze(1)

    model = DLRM()
    kill_at = args.warmup + args.steps // 3 if args.kill_mid_run else -1  # a donor dies a third of the way in
    rng = np.random.default_rng(1)
    steps = args.warmup + args.steps
    batches = [(torch.from_numpy(rng.standard_normal((args.batch, DENSE), dtype=np.float32)),
                torch.from_numpy(zipf_rows(rng, rows, (args.batch, LOOKUPS))),
                torch.from_numpy((rng.random(args.batch) < 0.25).astype(np.float32))) for _ in range(steps)]
    say(event="ready", base_rss=rss())
    local = wait_go()
    t0 = time.perf_counter()
    if args.mode == "region":
        place_embeddings(model, place.map(rows * DIM * 4, local), min_bytes=0)
    else:
        if args.mode == "local":
            w = torch.empty(rows, DIM)
        else:
            w = torch.from_numpy(place.array(rows * DIM * 4, local)).view(rows, DIM)
        model.emb.weight = torch.nn.Parameter(w)
        model.emb.reset_parameters()  # normal(0, 1), in place, as every mode does
    init_s = time.perf_counter() - t0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    t_start, timed, t_warm = None, 0, time.perf_counter()
    rebuild: dict = {}  # a kill run's: how long until the region was healthy again
    step_ends: list[float] = []  # each timed step's end, from the start of the timed part
    for k, (dense, idx, y) in enumerate(batches):
        if t_start is None and (k == args.warmup or time.perf_counter() - t_warm > args.max_seconds / 2):
            t_start = time.perf_counter()  # a slow variant ends its warm-up early
            st0 = place.stats()
            cpu0 = cpu_s()
            say(event="phase", name="timed")  # the bench samples the donors' CPU at each phase
        if k == kill_at:
            say(event="running")  # the bench kills a donor now; the run goes on without waiting
            rebuild = _time_rebuild(place.region)
        if args.mode == "region" and args.lookahead and k + 1 < len(batches):
            prefetch_lookups(model.emb, batches[k + 1][1])  # the next batch's rows, during this step
        opt.zero_grad()
        loss = loss_fn(model(dense, idx), y)
        loss.backward()
        opt.step()
        if t_start is not None:
            timed += 1
            step_ends.append(time.perf_counter() - t_start)
            if timed >= 3 and time.perf_counter() - t_start > args.max_seconds:
                break
    dt = time.perf_counter() - t_start
    timed_cpu = cpu_s() - cpu0
    say(event="phase", name="end")
    st = place.stats()
    if "thread" in rebuild:
        rebuild["thread"].join(60)
    return {"samples_per_s": timed * args.batch / dt, "step_ms": 1000 * dt / timed, "steps_timed": timed,
            "rebuild_s": rebuild.get("s"),
            "timed_program_cpu_s": timed_cpu, "timed_s": dt,
            "step_ms_each": [round(1000 * (b - a), 2) for a, b in zip([0.0] + step_ends, step_ends)],
            "init_s": init_s, "loss": float(loss.detach()), "rows": rows,
            "timed_stats": {k: st[k] - st0.get(k, 0) for k in st}}


def _time_rebuild(region, deadline_s: float = 60.0) -> dict:
    """From the kill until the region is healthy again (its loss seen, its copies rebuilt): the
    seconds, in ``out["s"]``, measured on a thread beside the run (none if that took over
    ``deadline_s``)."""
    out: dict = {}
    t0 = time.perf_counter()

    def watch() -> None:
        deadline = t0 + deadline_s
        while region.healthy():  # the loss is not seen yet
            if time.perf_counter() > deadline:
                return
            time.sleep(0.01)
        while not region.healthy():
            if time.perf_counter() > deadline:
                return
            time.sleep(0.01)
        out["s"] = round(time.perf_counter() - t0, 3)

    out["thread"] = threading.Thread(target=watch, daemon=True)
    out["thread"].start()
    return out


def scan(args, place: Place) -> dict:
    say(event="ready", base_rss=rss())
    local = wait_go()
    t0 = time.perf_counter()
    a = place.array(args.ws, local)
    per = CHUNK // 4
    n_chunks = len(a) // per
    for c in range(n_chunks):  # data preparation writes the array once
        a[c * per:(c + 1) * per] = np.float32(c)
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(2)
    total = 0.0
    times = []
    done = 0
    st0 = {}
    for p in range(args.scan_warmup + args.passes):
        if p == args.scan_warmup:
            st0 = place.stats()
        t = time.perf_counter()
        for c in rng.permutation(n_chunks):
            total += float(a[c * per:(c + 1) * per].sum(dtype=np.float64))
        done += 1
        if p >= args.scan_warmup:
            times.append(time.perf_counter() - t)
            if sum(times) > args.max_seconds:
                break
    want = float(sum(range(n_chunks))) * per * done
    st = place.stats()
    return {"gbps": len(times) * n_chunks * CHUNK / sum(times) / 1e9, "pass_s": times, "init_s": init_s,
            "checksum_ok": total == want, "timed_stats": {k: st[k] - st0.get(k, 0) for k in st}}


def stream(args, place: Place) -> dict:
    say(event="ready", base_rss=rss())
    wait_go()
    ws = args.ws
    local = max(4 * MIB, ws // 32)  # almost all of it on donors
    region = place.map(ws, local)
    a = region.array(np.uint8)
    n_chunks = ws // CHUNK
    for c in range(n_chunks):  # written once, so every chunk has data on the donors
        a[c * CHUNK:(c + 1) * CHUNK] = c % 251
    region.flush()
    buf = place.mem.alloc(ws)
    out = np.empty(CHUNK, np.uint8)
    pages_per = CHUNK // buf.page
    for c in range(n_chunks):
        out[:] = c % 251
        buf.write_pages(np.arange(c * pages_per, (c + 1) * pages_per), out)
    rng = np.random.default_rng(5)
    region_s, plane_s, wrong = [], [], 0
    st0 = region.stats()
    region_cpu, plane_cpu = [], []
    for _ in range(args.passes):
        order = rng.permutation(n_chunks)
        say(event="phase", name="region")  # the bench samples the donors' CPU at each phase
        t, c0 = time.perf_counter(), cpu_s()
        for c in order:  # the region: each chunk in order, as a reader of a file would
            wrong += int(int(a[c * CHUNK:(c + 1) * CHUNK].max()) != c % 251)
        region_s.append(time.perf_counter() - t)
        region_cpu.append(cpu_s() - c0)
        say(event="phase", name="dataplane")
        t, c0 = time.perf_counter(), cpu_s()
        for c in order:  # the data plane: the same chunk as one batched read
            buf.read_pages(np.arange(c * pages_per, (c + 1) * pages_per), out)
            wrong += int(int(out[-1]) != c % 251)
        plane_s.append(time.perf_counter() - t)
        plane_cpu.append(cpu_s() - c0)
    say(event="phase", name="end")
    st = region.stats()
    buf.free()
    region_gbps = [ws / s / 1e9 for s in region_s]
    plane_gbps = [ws / s / 1e9 for s in plane_s]
    return {"stream_gbps": float(np.median(region_gbps)), "dataplane_gbps": float(np.median(plane_gbps)),
            "stream_passes_gbps": region_gbps, "dataplane_passes_gbps": plane_gbps, "wrong_chunks": wrong,
            "local_bytes": local, "stream_stats": {k: st[k] - st0[k] for k in st},
            "stream_program_cpu_s": region_cpu, "dataplane_program_cpu_s": plane_cpu,
            "stream_s": region_s, "dataplane_s": plane_s}


def latency(args, place: Place) -> dict:
    say(event="ready", base_rss=rss())
    wait_go()
    rng = np.random.default_rng(3)
    out = {}
    for unit in args.units:
        args.unit, args.prefetch_bytes = unit, 0  # single faults: no sequential prefetch
        nbytes = max(64 * MIB, min(256 * MIB, unit * 4 * args.samples))
        region = place.map(nbytes, max(4 * unit, 4 * MIB))
        a = region.array(np.uint8)
        a[:] = 1
        region.flush()
        cold = rng.permutation(nbytes // unit - 2 * (4 * MIB // unit))[: args.samples]  # evicted by now
        lat = np.empty(len(cold), np.int64)
        for i, u in enumerate(cold):
            off = int(u) * unit + 17
            t = time.perf_counter_ns()
            a[off]  # noqa: B018 - the touch is the measurement
            lat[i] = time.perf_counter_ns() - t
        st = region.stats()
        out[str(unit)] = {"p50_us": float(np.percentile(lat, 50)) / 1000, "p99_us": float(np.percentile(lat, 99)) / 1000,
                          "samples": len(lat), "faults": st["faults_missing"], "fetched": st["fetched_units"]}
        region.close()
        place.region = None
    return {"fault": out}


def kill(args, place: Place) -> dict:
    say(event="ready", base_rss=rss())
    local = wait_go()
    region = place.map(args.ws, local)
    a = region.array(np.int64)
    per = CHUNK // 8
    n_chunks = len(a) // per
    for c in range(n_chunks):  # chunk by chunk: a whole-array temporary would not fit the limit
        a[c * per:(c + 1) * per] = np.arange(c * per, (c + 1) * per, dtype=np.int64)
    killed = threading.Event()

    def listen() -> None:
        if sys.stdin.readline().strip() == "killed":
            killed.set()

    threading.Thread(target=listen, daemon=True).start()
    rng = np.random.default_rng(4)
    passes = after = 0
    while after < 2:
        for c in rng.permutation(n_chunks):
            a[c * per:(c + 1) * per] += 1
        passes += 1
        if passes == 1:
            say(event="running")
        if killed.is_set():
            after += 1
        elif passes > 200:
            raise SystemExit("the bench never said killed")
    lost = 0
    for c in range(n_chunks):
        lo = c * per * 8
        try:
            region.check(lo, per * 8)
        except Exception:  # noqa: BLE001 - DataLostError: these bytes are gone (touching them is SIGBUS)
            lost += per * 8
            continue
        got = a[c * per:(c + 1) * per]
        lost += 8 * int(np.count_nonzero(got != np.arange(c * per, (c + 1) * per, dtype=np.int64) + passes))
    return {"lost_bytes": lost, "passes": passes, "passes_after_kill": after,
            "healthy": place.mem.wait_healthy(region.buffer, 30), "memory_stats": dict(place.mem.stats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.paging_work")
    p.add_argument("workload", choices=["dlrm", "scan", "stream", "latency", "kill"])
    p.add_argument("--mode", choices=["local", "memmap", "region"], default="local")
    p.add_argument("--ws", type=int, default=256 * MIB, help="working set, bytes")
    p.add_argument("--broker", default="")
    p.add_argument("--dir", default="/var/tmp", help="memmap: directory of the file")
    p.add_argument("--unit", type=int, default=4096)
    p.add_argument("--units", type=int, nargs="*", default=[4096, 64 << 10])
    p.add_argument("--policy", default="clock")
    p.add_argument("--prefetch-bytes", type=int, default=1 << 20)
    p.add_argument("--workers", type=int, default=None, help="fetch workers (default: the region's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--scan-warmup", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=60.0, help="end the timed part after this (3 steps at least)")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--kill-mid-run", action="store_true", help="dlrm: say 'running' a third of the way in")
    p.add_argument("--rebuild-bytes-per-s", type=int, default=0, help="region: RemoteMemory's cap on rebuilds")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                   help="dlrm on a region: do not ask for the next batch's rows during a step")
    args = p.parse_args(argv)
    place = Place(args)
    try:
        res = {"dlrm": dlrm, "scan": scan, "stream": stream, "latency": latency,
               "kill": kill}[args.workload](args, place)
        res["region_stats"] = place.stats()
        if _CPU_AT_GO:  # CPU seconds of this program (every thread: the workload and the engine) since go
            res["program_cpu_s"] = cpu_s() - _CPU_AT_GO[0]
        res["peak_rss"] = psutil.Process().memory_info().rss
        say(event="result", **res)
    finally:
        place.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
