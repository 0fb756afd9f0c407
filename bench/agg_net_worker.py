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
from aggregator.client import DEFAULT_CHUNK_BYTES
from aggregator.torch import AggState, comm_hook


def build_model(width: int) -> nn.Module:
    """Mostly dense: 2 * 1024 * width + width**2 weights; width 4096 gives 25.2M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1024))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Timing:
    """Wraps the hook: records each step's comm window, and kills a server mid-step when asked."""

    def __init__(self, kill_pid: int = 0, kill_step: int = -1) -> None:
        self.windows: dict[int, list[float]] = {}
        self.kill_pid, self.kill_step, self.killed_at = kill_pid, kill_step, None

    def hook(self, state: AggState, bucket):
        rnd = state.iteration
        w = self.windows.setdefault(rnd, [time.time(), 0.0])
        fut = comm_hook(state, bucket)
        if self.kill_pid and rnd == self.kill_step and self.killed_at is None:
            self.killed_at = time.time()
            os.kill(self.kill_pid, signal.SIGKILL)  # a round is in flight: this bucket was just handed over

        def done(f):
            w[1] = max(w[1], time.time())
            return f.value()

        return fut.then(done)


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


def run_phase(spec: dict[str, Any], ph: dict[str, Any], barrier: _CrossJobBarrier) -> tuple[dict, list]:
    rank, world = spec["rank"], spec["world"]
    model = build_model(spec["width"])
    ddp = DDP(model)
    client, timing = None, _Timing(ph.get("kill_pid", 0) if rank == 0 else 0, ph.get("kill_step", -1))
    if ph.get("servers"):
        client = Client(ph["servers"], f"{spec['job']}-{ph['name']}", rank, world, timeout_s=300,
                        connect_timeout_s=60, chunk_bytes=spec.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        ddp.register_comm_hook(AggState(client, compression=ph.get("compress")), timing.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    warmup, steps, compute_s = spec["warmup"], ph["steps"], ph.get("compute_s", 0.0)
    barrier.wait(f"start-{ph['name']}")
    if ph.get("offset_s"):
        time.sleep(ph["offset_s"])
    times, starts = [], []
    w0 = c0 = 0.0
    for i in range(steps):
        if i == warmup:
            w0, c0 = time.time(), _cpu_s()
        x = torch.randn(spec["batch"], 1024, generator=g)
        y = torch.randn(spec["batch"], 1024, generator=g)
        t0 = time.perf_counter()
        starts.append(time.time())
        if compute_s:
            time.sleep(compute_s)  # stands in for the GPU's forward and backward: a GPU host's CPU idles
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    w1, c1 = time.time(), _cpu_s()
    params = [p.detach().clone() for p in model.parameters()]
    out: dict[str, Any] = {"step_s": times, "window": [w0, w1], "cpu_s": c1 - c0, "step_starts": starts,
                           "comm": [timing.windows[r] for r in sorted(timing.windows) if r >= warmup]}
    if client is not None:
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
