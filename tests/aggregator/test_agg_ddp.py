"""Real DDP on CPU (gloo for DDP's own set-up) with the aggregation hook, against plain DDP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aggregator import AggregationServer, ServerSettings
from nodesvc.bus.procs import free_port
from tests.aggregator.aggtest import addr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run_ddp(world: int, servers: list[str], tmp_path: Path, steps: int = 6, extra: tuple = ()) -> list[dict]:
    """``world`` ranks of ddp_worker.py; each one's results (plain, hooked, compressed runs)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.pt"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "ddp_worker.py"), "--rank", str(rank), "--world", str(world), "--init", init,
             "--agg", ",".join(servers), "--steps", str(steps), "--out", str(out), "--job", f"ddp{world}", *extra],
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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks, started once for the module: plain DDP, the hook on one server, and the hook with each
    wire compression on a server of its own.  Yields (the ranks' results, {run: its server})."""
    made = {run: AggregationServer(ServerSettings(server_id=f"ddp2-{run}", round_timeout_s=5.0, max_cores=2)).start()
            for run in ("hook", "fp16", "bf16")}
    try:
        extra = [arg for wire in ("fp16", "bf16") for arg in ("--compressed", f"{wire}={addr(made[wire])}")]
        yield _run_ddp(2, [addr(made["hook"])], tmp_path_factory.mktemp("ddp2"), extra=tuple(extra)), made
    finally:
        for srv in made.values():
            srv.stop()


def test_ddp_two_ranks_bit_identical_to_plain_ddp(two_ranks):
    results, _ = two_ranks
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
    # Each server received exactly the bytes of the buckets the client's placement gives it (which
    # one depends on the servers' random ports; a 10 KiB bucket is one chunk).
    from aggregator.placement import Placement

    place = Placement([addr(s) for s in servers], "ddp4")
    want = {addr(s): 0 for s in servers}
    for res in results:
        for _, key, numel in res["seen"]:
            want[place.server_for(key, 0)] += numel * 4
    assert {addr(s): s.bytes_in for s in servers} == want
    assert sum(v > 0 for v in want.values()) == 2  # both servers were used


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_ddp_with_wire_compression_sends_half_the_bytes_and_stays_close(two_ranks, wire):
    results, servers = two_ranks
    runs = [res["compressed"][wire] for res in results]
    sent = sum(numel for run in runs for _, _, numel in run["seen"])
    assert sent > 0 and servers[wire].bytes_in == 2 * sent  # 16-bit elements on the wire, not 32
    tol = {"fp16": 2e-3, "bf16": 2e-2}[wire]  # the wire rounding of each step's mean gradient
    for res, run in zip(results, runs):
        diffs = [(p - q).abs().max().item() for p, q in zip(res["plain"], run["hook"])]
        assert 0 < max(diffs) < tol, diffs  # it did round, and only a little
    assert all(torch.equal(p, q) for p, q in zip(runs[0]["hook"], runs[1]["hook"]))  # the same rounded means


def _initial() -> list[torch.Tensor]:
    from tests.aggregator.ddp_worker import build

    return [p.detach() for p in build().parameters()]


pytestmark = pytest.mark.slow
