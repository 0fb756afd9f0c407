"""One rank of the DDP equality tests: train the same tiny model with plain DDP, with the hook, and
with the hook and each wire compression asked for (``--compressed fp16=HOST:PORT``: its own server, so
that each server's byte count is one run's).

Run by test_agg_ddp.py as a real process: ``python ddp_worker.py --rank R --world W ...``.  One process
trains every variant: a rank's start (torch's import, the process group) is most of a short run's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from aggregator import Client  # noqa: E402
from aggregator.torch import AggState, comm_hook  # noqa: E402


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def train(rank: int, steps: int, client: Client | None, compression: str | None = None) -> list[torch.Tensor]:
    model = build()
    # 10 KiB buckets: DDP starts with one bucket (its first-bucket cap is 1 MiB) and re-lays out
    # into several after iteration 0, which the hook must cope with.
    ddp = DDP(model, bucket_cap_mb=0.01)
    if client is not None:
        ddp.register_comm_hook(AggState(client, compression=compression), comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class TracingClient(Client):
    """Records (round, key, elements) of every bucket the hook reduces."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list = []

    def allreduce_async(self, x, op="mean", key=0, round=None, **kw):
        self.seen.append((round, key, x.numel()))
        return super().allreduce_async(x, op, key, round, **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--agg", required=True)
    ap.add_argument("--job", default="ddp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--compressed", action="append", default=[], metavar="WIRE=HOST:PORT",
                    help="also train with the hook and this wire compression (fp16, bf16) on this server")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    plain = train(a.rank, a.steps, None)
    with TracingClient(a.agg.split(","), a.job, a.rank, a.world, timeout_s=30) as client:
        hooked = train(a.rank, a.steps, client)
        seen = client.seen
    compressed = {}
    for item in a.compressed:
        wire, server = item.split("=", 1)
        if wire not in ("fp16", "bf16"):
            ap.error(f"--compressed {item}: the wire is fp16 or bf16")
        with TracingClient([server], f"{a.job}-{wire}", a.rank, a.world, timeout_s=30) as client:
            compressed[wire] = {"hook": train(a.rank, a.steps, client, wire), "seen": client.seen}
    torch.save({"plain": plain, "hook": hooked, "seen": seen, "compressed": compressed}, a.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
