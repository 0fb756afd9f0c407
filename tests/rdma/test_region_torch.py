"""The PyTorch helper: embedding tables and named tensors in a region, trained with sparse SGD and
Adagrad, step for step equal to the same model in local memory."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nodesvc.bus.procs import wait_until  # noqa: E402
from rdma.torch import place_embeddings, place_optimizer_state, place_tensors, prefetch_lookups  # noqa: E402
from tests.rdma.regions import SLAB  # noqa: E402

ROWS, DIM = 16384, 32  # a 2 MiB table (and Adagrad's 2 MiB of sums); the region keeps 1 MiB resident


class Tiny(torch.nn.Module):
    def __init__(self, device=None) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, device=device)
        self.side = torch.nn.Embedding(ROWS // 4, 8, sparse=True, device=device)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM + 8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, idx, side):
        return self.mlp(torch.cat([self.emb(idx), self.side(side)], dim=1)).squeeze(1)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        # skewed lookups: a few hot rows, a long tail, spread over the table
        hot = torch.randint(0, 64, (128, 4), generator=g) * 251 % ROWS
        cold = torch.randint(0, ROWS, (128, 4), generator=g)
        yield (torch.cat([hot, cold], dim=1), torch.randint(0, ROWS // 4, (128,), generator=g),
               torch.rand(128, generator=g))


def train(model, opt, steps):
    loss_fn = torch.nn.MSELoss()
    for idx, side, y in batches(steps):
        opt.zero_grad()
        loss_fn(model(idx, side), y).backward()
        opt.step()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_sparse_training_on_placed_tables_matches_local(local_cluster, optimizer):
    torch.manual_seed(0)
    local = Tiny()
    placed = copy.deepcopy(local)
    region, _ = local_cluster.region(6 * SLAB, local_bytes=SLAB, unit=16 << 10)
    moved = place_embeddings(placed, region, min_bytes=1 << 20)
    assert moved == ["emb.weight"]  # the 512 KiB side table stays local
    moved += place_tensors(placed, region, ["side.weight"])
    w = placed.emb.weight
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert region.address <= w.data_ptr() < region.address + region.nbytes
    assert torch.equal(placed.emb.weight, local.emb.weight) and torch.equal(placed.side.weight, local.side.weight)

    def make(m):
        sparse = [m.emb.weight, m.side.weight]
        dense = list(m.mlp.parameters())
        if optimizer == "sgd":
            return [torch.optim.SGD(sparse, lr=0.1), torch.optim.SGD(dense, lr=0.05)]
        return [torch.optim.Adagrad(sparse, lr=0.1), torch.optim.Adagrad(dense, lr=0.05)]

    class Both:
        def __init__(self, opts):
            self.opts = opts

        def zero_grad(self):
            for o in self.opts:
                o.zero_grad()

        def step(self):
            for o in self.opts:
                o.step()

    lo, po = make(local), make(placed)
    if optimizer == "adagrad":
        assert place_optimizer_state(po[0], region, min_bytes=1 << 20) == 1  # emb's sum; side's is small
        state = po[0].state[placed.emb.weight]["sum"]
        assert region.address <= state.data_ptr() < region.address + region.nbytes
    train(local, Both(lo), 20)
    train(placed, Both(po), 20)
    assert placed.emb.weight.grad is not None and placed.emb.weight.grad.is_sparse
    assert torch.equal(placed.emb.weight, local.emb.weight)  # bit for bit: same kernels, same order
    assert torch.equal(placed.side.weight, local.side.weight)
    for a, b in zip(placed.mlp.parameters(), local.mlp.parameters()):
        assert torch.equal(a, b)
    st = region.stats()
    assert st["evicted_dirty"] > 0 and st["fetched_units"] > 0  # the table really went through the donors
    region.flush()


def test_a_meta_table_is_built_in_the_region_and_lookups_prefetch(local_cluster):
    region, _ = local_cluster.region(8 * SLAB, local_bytes=512 << 10, unit=16 << 10)
    model = Tiny(device="meta")
    model.mlp = Tiny().mlp
    assert place_embeddings(model, region, min_bytes=1 << 20) == ["emb.weight"]
    w = model.emb.weight
    assert not w.is_meta and w.shape == (ROWS, DIM)
    assert 0.9 < float(w.detach()[:2048].std()) < 1.1  # reset_parameters ran: normal(0, 1), in place
    other = region.array(np.uint8, 4 * SLAB)
    other[:] = 1  # a stream of writes: the engine evicts it as it goes, so the table stays...
    region.prefetch(int(other.ctypes.data) - region.address, other.nbytes)  # ...until other pages are asked for
    rows = torch.tensor([[5, 9000, 15000, 123]])
    units = sorted({int(r) * DIM * 4 // region.unit for r in rows.reshape(-1)})
    assert {region.unit_state(u) for u in units} == {"absent"}
    before = region.stats()
    model.emb.train()
    model.emb(rows)
    after = region.stats()
    # the hook asked for the rows' units before the lookup touched them, writable (training: the
    # optimiser writes them next), so the lookup took no fault and the update will take none either.
    # A unit the lookup read right after its copy, before the engine settled it, says "fetching" for
    # those microseconds (test_pager.py, test_a_thread_woken_from_a_fault_finds_its_unit_settled):
    # wait for the states, then look.
    wait_until(lambda: "fetching" not in {region.unit_state(u) for u in units}, 10, "the units to settle")
    assert {region.unit_state(u) for u in units} == {"dirty"}
    assert after["fetched_units"] - before["fetched_units"] >= len(units)
    assert after["faults_wp"] == before["faults_wp"]


def test_the_next_batchs_rows_are_fetched_ahead_and_its_lookup_takes_no_fault(local_cluster):
    region, _ = local_cluster.region(8 * SLAB, local_bytes=512 << 10, unit=16 << 10)
    model = Tiny(device="meta")
    model.mlp = Tiny().mlp
    place_embeddings(model, region, min_bytes=1 << 20)
    other = region.array(np.uint8, 4 * SLAB)
    other[:] = 1
    region.prefetch(int(other.ctypes.data) - region.address, other.nbytes)  # pushes the table out of local memory
    rows = torch.tensor([[7, 8100, 14000, 321]])
    units = sorted({int(r) * DIM * 4 // region.unit for r in rows.reshape(-1)})
    assert {region.unit_state(u) for u in units} == {"absent"}
    model.emb.train()
    assert prefetch_lookups(model.emb, rows) == len(units)  # returns at once: the fetch runs meanwhile
    wait_until(lambda: {region.unit_state(u) for u in units} == {"dirty"}, 10, "the rows asked for ahead")
    before = region.stats()
    out = model.emb(rows)
    after = region.stats()
    assert after["faults_missing"] == before["faults_missing"] and after["faults_wp"] == before["faults_wp"]
    assert after["fetched_units"] == before["fetched_units"]  # nothing left to fetch at the lookup
    assert torch.allclose(out, torch.nn.functional.embedding(rows, model.emb.weight.detach()).sum(dim=1))
    assert prefetch_lookups(model.mlp[0], rows) == 0  # not a placed table: nothing to do


def test_dataloader_workers_forked_over_a_region_fail_loudly(local_cluster):
    region, _ = local_cluster.region(2 * SLAB, local_bytes=SLAB)
    data = region.tensor(torch.float32, (2 * SLAB // 4,))
    data.copy_(torch.arange(data.numel(), dtype=torch.float32))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 1024

        def __getitem__(self, i):
            return data[i * 64:(i + 1) * 64].sum()

    # in the main process the dataset reads right
    assert float(Rows()[3]) == float(np.arange(192, 256).sum())
    loader = torch.utils.data.DataLoader(Rows(), batch_size=64, num_workers=1,
                                         multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
        for _ in loader:
            pass
    assert float(data[:64].sum()) == float(np.arange(64).sum())  # the parent is unharmed
