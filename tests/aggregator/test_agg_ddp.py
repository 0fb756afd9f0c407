"""Real DDP on CPU (gloo for DDP's own set-up) with the aggregation hook, against plain DDP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nodesvc.bus.procs import free_port
from tests.aggregator.aggtest import addr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run_ddp(world: int, servers: list[str], tmp_path: Path, steps: int = 6) -> list[dict]:
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.pt"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "ddp_worker.py"), "--rank", str(rank), "--world", str(world), "--init", init,
             "--agg", ",".join(servers), "--steps", str(steps), "--out", str(out), "--job", f"ddp{world}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{p.stdout.read().decode()[-3000:]}"
    return [torch.load(o) for o in outs]


def _check_relayout(res: dict) -> None:
    rounds: dict[int, list] = {}
    for it, idx, numel in res["seen"]:
        rounds.setdefault(it, []).append((idx, numel))
    assert len(rounds[0]) == 1, "DDP's first iteration uses one bucket for this model"
    assert len(rounds[1]) > 1, "after iteration 0 DDP re-lays out into several buckets"
    assert sum(n for _, n in rounds[0]) == sum(n for _, n in rounds[1])


def test_ddp_two_ranks_bit_identical_to_plain_ddp(agg_servers, tmp_path):
    (srv,) = agg_servers(1, max_cores=2)
    results = _run_ddp(2, [addr(srv)], tmp_path)
    for res in results:
        _check_relayout(res)
        for p, q in zip(res["plain"], res["hook"]):
            assert torch.equal(p, q), f"max diff {(p - q).abs().max().item()}"
        assert any(not torch.equal(p, q) for p, q in zip(res["plain"], _initial()))  # it did train
    for p, q in zip(results[0]["hook"], results[1]["hook"]):
        assert torch.equal(p, q)


def test_ddp_four_ranks_within_1e6_relative_on_two_servers(agg_servers, tmp_path):
    servers = agg_servers(2, max_cores=2)
    results = _run_ddp(4, [addr(s) for s in servers], tmp_path)
    for res in results:
        _check_relayout(res)
        for p, q in zip(res["plain"], res["hook"]):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    for res in results[1:]:
        for p, q in zip(results[0]["hook"], res["hook"]):
            assert torch.equal(p, q)  # every rank holds the same parameters
    # Exactly the servers the client's hash ring routes the buckets to received data (which ones
    # depends on the servers' random ports; a bucket is one chunk at this size).
    from aggregator.client import HashRing

    ring = HashRing([addr(s) for s in servers])
    want = {ring.route(f"ddp4/{key}/0") for res in results for _, key, _ in res["seen"]}
    assert want and {addr(s) for s in servers if s.bytes_in > 0} == want


def _initial() -> list[torch.Tensor]:
    from tests.aggregator.ddp_worker import build

    return [p.detach() for p in build().parameters()]


pytestmark = pytest.mark.slow
