"""One training job of ``dlshare bench cache`` (bench/cache.py), in its own process and memory cgroup.

An ImageNet-like input pipeline over the JPEG files the bench wrote: PIL decode, resize to 224x224,
a uint8 CHW tensor (the deterministic part, cached or not), then a random flip and float
normalisation after the cache, in ``--workers`` persistent DataLoader workers (fork).  A fixed time per sample
stands in for the GPU step (a GPU does not use the host's cores), so the input pipeline is the
bottleneck, as on real GPU nodes.

Protocol on stdin/stdout (JSON lines): ``ready`` (the process's footprint before any cache),
then it waits for ``go``; ``epoch`` after every epoch; for the ``lent`` variant ``filled`` (then
it keeps its cache up until ``done`` on stdin, so a second job can attach); for ``kill``, ``mid``
half way through the second epoch (the bench kills a donor and answers ``killed``); ``result``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

SIDE = 224


class JpegFolder:
    """Map-style dataset of the bench's JPEG files: decode and resize (deterministic)."""

    def __init__(self, root: str) -> None:
        self.files = sorted(str(p) for p in Path(root).glob("*.jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import torch
        from PIL import Image

        with Image.open(self.files[i]) as im:
            arr = np.asarray(im.convert("RGB").resize((SIDE, SIDE), Image.BILINEAR))
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), i


def augment(sample):
    """Random flip and normalisation: after the cache, on every access."""
    import torch

    x, y = sample
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    return (x.float() / 255.0 - 0.45) / 0.225, y


class Augmented:
    """The uncached pipeline: the same augmentation, in the workers too."""

    def __init__(self, data) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return augment(self.data[i])


def emit(event: str, **kw) -> None:
    print(json.dumps({"event": event, **kw}), flush=True)


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_remote(cache, n: int, threads: int) -> dict:
    """Read ``n`` remote-only entries back: p50 of one read, and the rate of ``threads`` readers."""
    idx = [i for i in range(cache.slots) if cache.where(i) in ("remote", "both")][:n]
    if not idx:
        return {}
    lat = []
    nbytes = 0
    for i in idx:
        t = time.perf_counter()
        out = cache.get(i, tier="remote")
        lat.append(time.perf_counter() - t)
        nbytes += len(out) if out is not None else 0
    per = nbytes / max(1, len(idx))
    small = []  # one 4 KiB read at the slab server, the fixed cost of a read (the model's per-read latency)
    segs, _ = cache.remote.table()
    buf = np.empty(4096, np.uint8)
    for i in idx[:200]:
        rec = cache.state.read_slot(i)
        copies = segs.get(int(rec["rseg"]) - 1, ()) if rec is not None and rec["rseg"] else ()
        live = [c for c in copies if c.state == "live"]
        if not live:
            continue
        ep = cache.remote.endpoint(live[0].addr)
        t = time.perf_counter()
        ep.read(live[0].slab, live[0].token, [int(rec["roff"])], [4096], buf)
        small.append(time.perf_counter() - t)
    done = [0]

    def reader(part):
        for i in part:
            out = cache.get(i, tier="remote")
            done[0] += len(out) if out is not None else 0

    parts = [idx[k::threads] for k in range(threads)]
    t = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(p,)) for p in parts]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    wall = time.perf_counter() - t
    return {"read_4k_p50_s": float(np.median(small)) if small else None, "sample_read_p50_s": float(np.median(lat)), "sample_read_p99_s": float(np.percentile(lat, 99)),
            "sample_bytes": per, "read_bytes_per_s": done[0] / wall if wall > 0 else None, "reads": len(idx),
            "threads": threads}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=["none", "local", "lent", "all_local", "attach", "kill"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu-s-per-sample", type=float, default=0.0005)
    ap.add_argument("--remote-bytes", type=int, default=0)
    ap.add_argument("--broker", default="")
    ap.add_argument("--name", default="bench-cache")
    ap.add_argument("--secret", default="")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from torch.utils.data import DataLoader

    from rdma.dataset import CachedDataset
    from rdma.sample_cache import SampleCache

    torch.set_num_threads(1)
    data = JpegFolder(a.dir)
    emit("ready", base_rss=rss(), samples=len(data))
    line = sys.stdin.readline().split()
    local = int(line[1]) if len(line) > 1 else 0
    cache = None
    if a.variant in ("local", "all_local"):
        cache = SampleCache(len(data), local_bytes=local, local_segment_bytes=8 << 20)
    elif a.variant in ("lent", "kill"):
        named = a.variant == "lent"
        cache = SampleCache(len(data), local_bytes=local, local_segment_bytes=8 << 20, remote_bytes=a.remote_bytes,
                            broker=a.broker, name=a.name if named else None, secret=a.secret if named else None,
                            spare_segments=4)
    elif a.variant == "attach":
        cache = SampleCache.attach(a.name, a.secret, a.broker, reader_id="bench-job-e")
    ds = CachedDataset(data, cache, after=augment) if cache is not None else Augmented(data)
    epochs = []
    wrong = 0
    checked = 0
    # persistent workers, as training scripts use them: forked once, before anything is cached, so every
    # entry a worker finds later was stored by another process or an earlier epoch
    loader = DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                        persistent_workers=a.workers > 0, generator=torch.Generator().manual_seed(a.seed))
    for ep in range(a.epochs):
        before = cache.stats() if cache is not None else {}
        n = 0
        t0 = time.perf_counter()
        for bi, (x, y) in enumerate(loader):
            n += len(y)
            time.sleep(a.gpu_s_per_sample * len(y))  # the GPU step
            if a.variant == "kill" and ep == 1:
                if bi == len(loader) // 2:
                    emit("mid")
                    sys.stdin.readline()  # the bench killed a donor
                for k in range(len(y)):  # the deterministic part against the uncached pipeline
                    raw = cache.get(int(y[k]))
                    ref = data[int(y[k])][0]
                    if raw is not None:
                        from rdma.sample_codec import decode

                        got = decode(raw)[0]
                        checked += 1
                        wrong += int(not torch.equal(got, ref))
        wall = time.perf_counter() - t0
        after = cache.stats() if cache is not None else {}
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits_local", "hits_remote", "misses")}
        reads = sum(d.values())
        rec = {"epoch": ep, "samples": n, "wall_s": wall, "samples_per_s": n / wall,
               "hit_local": d["hits_local"] / reads if reads else 0.0,
               "hit_remote": d["hits_remote"] / reads if reads else 0.0, "load1": os.getloadavg()[0]}
        epochs.append(rec)
        emit("epoch", **rec)
    result = {"epochs": epochs, "rss": rss()}
    if cache is not None:
        st = cache.stats()
        result["cache"] = {k: v for k, v in st.items() if not isinstance(v, dict)}
        if a.variant == "lent":
            cache.flush()
            result["remote_read"] = measure_remote(cache, min(400, len(data)), max(1, a.workers))
            emit("filled")
            sys.stdin.readline()  # "done": the attached job has finished
            result["readers"] = cache.stats()["readers"]
    if a.variant == "kill":
        result["kill"] = {"wrong_samples": wrong, "checked": checked,
                          "memory": cache.mem.stats if cache.mem else {}, "cache": cache.stats()}
    emit("result", **result)
    if cache is not None:
        cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
