"""One worker host of ``dlshare bench agg --network``: DDP training phases, one after another.

Run by bench/agg_network.py inside the host's network namespace:
``python -m bench.agg_net_worker SPEC.json``.  The spec names this rank, its
job, the gloo rendezvous, and the phases; each phase trains the same model on
the same data from the same initial weights, with plain DDP (gloo's ring
all-reduce) or with the dlshare hook on a list of aggregation servers.  The
result JSON has, per phase, the step times, the wall-clock window of the
measured steps (the orchestrator reads link counters and server CPU over it),
this process's CPU time over that window, the comm windows of each step (from
the first bucket handed to the hook to the last bucket reduced), and
parameter differences against the reference phase.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aggregator import Client
from aggregator.torch import AggState, comm_hook


def build_model(width: int) -> nn.Module:
    """Mostly dense: 2 * 1024 * width + width**2 weights; width 4096 gives 25.2M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1024))


def _wakeups() -> int:
    """Voluntary context switches of every thread of this process so far (each is a sleep and a wake-up)."""
    total = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Timing:
    """Wraps the hook: records each step's comm window and each bucket's hand-over and completion,
    and kills a server mid-step when asked."""

    def __init__(self, kill_pid: int = 0, kill_step: int = -1) -> None:
        self.windows: dict[int, list[float]] = {}
        self.buckets: list[dict[str, Any]] = []  # {"round", "key", "bytes", "ready", "done"}
        self.kill_pid, self.kill_step, self.killed_at = kill_pid, kill_step, None

    def _track(self, rnd: int, bucket, fut):
        w = self.windows.setdefault(rnd, [time.time(), 0.0])
        rec = {"round": rnd, "key": bucket.index(), "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
               "ready": time.time(), "done": 0.0}
        self.buckets.append(rec)

        def done(f):
            rec["done"] = time.time()
            w[1] = max(w[1], rec["done"])
            return f.value()

        return done

    def hook(self, state: AggState, bucket):
        rnd = state.iteration
        t = time.time()
        fut = comm_hook(state, bucket)
        done = self._track(rnd, bucket, fut)
        self.buckets[-1]["ready"] = t
        self.windows[rnd][0] = min(self.windows[rnd][0], t)
        if self.kill_pid and rnd == self.kill_step and self.killed_at is None:
            self.killed_at = time.time()
            os.kill(self.kill_pid, signal.SIGKILL)  # a round is in flight: this bucket was just handed over
        return fut.then(done)


class _RingTiming(_Timing):
    """gloo's ring with the same per-bucket records: DDP's own all-reduce (divide, then sum), as a hook."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.iteration = world, 0

    def hook(self, _state, bucket):
        rnd = self.iteration
        if bucket.is_last():
            self.iteration += 1
        t = time.time()
        buf = bucket.buffer().div_(self.world)
        fut = dist.all_reduce(buf, async_op=True).get_future()
        done = self._track(rnd, bucket, fut)
        self.buckets[-1]["ready"] = t
        self.windows[rnd][0] = min(self.windows[rnd][0], t)
        return fut.then(lambda f: done(f)[0])


class _CrossJobBarrier:
    """All workers of all jobs in a phase start together (a TCPStore on the first job's rank 0)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        b = spec.get("barrier")
        self.store = None
        if b:
            self.n, self.me = b["world"], f"{spec['job']}/{spec['rank']}"
            self.store = dist.TCPStore(b["host"], b["port"], b["world"], b["master"],
                                       timeout=timedelta(seconds=300))
            self.names = b["names"]

    def wait(self, tag: str) -> None:
        if self.store is None:
            dist.barrier()
            return
        self.store.set(f"{tag}/{self.me}", "1")
        self.store.wait([f"{tag}/{n}" for n in self.names])


class _NoCommTiming(_RingTiming):
    """No communication at all: each bucket is 'reduced' at once (the compute floor of a step)."""

    def hook(self, _state, bucket):
        rnd = self.iteration
        if bucket.is_last():
            self.iteration += 1
        fut: torch.futures.Future = torch.futures.Future()
        done = self._track(rnd, bucket, fut)
        fut.set_result(bucket.buffer())
        return fut.then(done)


def run_phase(spec: dict[str, Any], ph: dict[str, Any], barrier: _CrossJobBarrier) -> tuple[dict, list]:
    rank, world = spec["rank"], spec["world"]
    model = build_model(spec["width"])
    ddp = DDP(model)
    client, timing = None, _Timing(ph.get("kill_pid", 0) if rank == 0 else 0, ph.get("kill_step", -1))
    if ph.get("servers"):
        opts = {k: ph.get(k, spec.get(k)) for k in ("chunk_bytes", "window_chunks", "link_gbit")}
        client = Client(ph["servers"], f"{spec['job']}-{ph['name']}", rank, world, timeout_s=300, connect_timeout_s=60,
                        trace=True, **{k: v for k, v in opts.items() if v is not None})
        ddp.register_comm_hook(AggState(client, compression=ph.get("compress")), timing.hook)
    else:
        timing = _NoCommTiming(world) if ph.get("no_comm") else _RingTiming(world)
        ddp.register_comm_hook(None, timing.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    warmup, steps, compute_s = spec["warmup"], ph["steps"], ph.get("compute_s", 0.0)
    barrier.wait(f"start-{ph['name']}")
    if ph.get("offset_s"):
        time.sleep(ph["offset_s"])
    times, starts, marks = [], [], []
    w0 = c0 = 0.0
    for i in range(steps):
        if i == warmup:
            w0, c0, v0 = time.time(), _cpu_s(), _wakeups()
        x = torch.randn(spec["batch"], 1024, generator=g)
        y = torch.randn(spec["batch"], 1024, generator=g)
        t0 = time.perf_counter()
        starts.append(time.time())
        if compute_s:
            time.sleep(compute_s)  # stands in for the GPU's forward and backward: a GPU host's CPU idles
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        t_fwd = time.time()
        loss.backward()
        t_bwd = time.time()
        opt.step()
        # step start, forward done, backward returned (every bucket reduced), optimizer done
        marks.append([starts[-1], t_fwd, t_bwd, time.time()])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    w1, c1, v1 = time.time(), _cpu_s(), _wakeups()
    params = [p.detach().clone() for p in model.parameters()]
    out: dict[str, Any] = {"step_s": times, "window": [w0, w1], "cpu_s": c1 - c0, "step_starts": starts,
                           "wakeups": v1 - v0,
                           "comm": [timing.windows[r] for r in sorted(timing.windows) if r >= warmup],
                           "marks": marks, "buckets": timing.buckets}
    if client is not None:
        out["stages"] = client.stage_records()
        st = client.stats()
        out["retries"] = st["retries"]
        out["bytes_sent"] = {a: s["bytes_sent"] for a, s in st["servers"].items()}
        out["killed_at"] = timing.killed_at
    barrier.wait(f"end-{ph['name']}")  # nobody closes its client while a peer still needs a round
    if client is not None:
        client.close()
    return out, params


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=spec["init"], rank=spec["rank"], world_size=spec["world"],
                            timeout=timedelta(seconds=600))
    barrier = _CrossJobBarrier(spec)
    results: dict[str, Any] = {}
    kept: dict[str, list] = {}
    for ph in spec["phases"]:
        print(f"phase {ph['name']} start", flush=True)
        res, params = run_phase(spec, ph, barrier)
        ref = ph.get("compare_to")
        if ref:
            res["param_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(kept[ref], params))
        if ph.get("keep"):
            kept[ph["name"]] = params
        results[ph["name"]] = res
        print(f"phase {ph['name']} done median {sorted(res['step_s'])[len(res['step_s']) // 2]:.3f}s",
              flush=True)
    with open(spec["out"], "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
