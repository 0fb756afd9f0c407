"""One rank of the DDP failover test: train with the hook twice, as two jobs: first the reference,
with every server up, then the faulty run, where rank 0 kills -9 a server mid-round.

Run by test_agg_failover.py as a real process (one process for both runs: a rank's start, torch's
import and the process group, is most of a short run's time).  Writes, for each run, the final
parameters, the client's retry count and how many bytes it pushed to the victim before and after.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from aggregator import Client  # noqa: E402
from aggregator.torch import AggState, comm_hook  # noqa: E402


class Killer:
    """The hook, plus a kill -9 of the victim right after the last bucket of step ``kill_step`` is handed
    over: every bucket of that round is then in flight or kept for a retry, on every rank."""

    def __init__(self, kill_pid: int, kill_step: int) -> None:
        self.kill_pid, self.kill_step, self.killed = kill_pid, kill_step, False

    def hook(self, state: AggState, bucket):
        rnd = state.iteration
        fut = comm_hook(state, bucket)
        if self.kill_pid and rnd == self.kill_step and bucket.is_last() and not self.killed:
            self.killed = True
            os.kill(self.kill_pid, signal.SIGKILL)
        return fut


def train(a: argparse.Namespace, job: str, kill_pid: int, pause_s: float) -> dict:
    """One training job with the hook; ``kill_pid``: the server rank 0 kills at step ``a.kill_step``."""
    servers = a.agg.split(",")
    victim = sorted(servers)[-1] if kill_pid else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets a step
    client = Client(servers, job, a.rank, a.world, chunk_bytes=16 << 10, timeout_s=60)
    killer = Killer(kill_pid if a.rank == 0 else 0, a.kill_step)
    ddp.register_comm_hook(AggState(client), killer.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + a.rank)
    at_kill, times, done = None, [], 0
    for _ in range(a.steps):
        time.sleep(pause_s)  # stands in for GPU time, so that a faulty run spans the victim's restart
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
        t0 = time.monotonic()
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
        times.append(time.monotonic() - t0)
        done += 1
        if victim and at_kill is None and client.stats()["servers"][victim]["state"] != "up":
            at_kill = client.stats()["servers"][victim]["bytes_sent"]
    st = client.stats()
    client.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": done,
            "retries": st["retries"], "killed": killer.killed, "max_step_s": max(times),
            "sent_to_victim_at_kill": at_kill,
            "sent_to_victim_after": st["servers"][victim]["bytes_sent"] if victim else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--rank", "--world", "--steps", "--kill-pid", "--kill-step"):
        ap.add_argument(flag, type=int, required=True)
    for flag in ("--init", "--agg", "--job", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--pause", type=float, default=0.25, help="seconds before each step of the faulty run")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    clean = train(a, f"{a.job}-clean", 0, 0.0)  # the reference: nothing to span, so no pause
    dist.barrier()  # every rank is done with the reference before rank 0 can kill a server
    fault = train(a, f"{a.job}-fault", a.kill_pid, a.pause)
    torch.save({"clean": clean, "fault": fault}, a.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
