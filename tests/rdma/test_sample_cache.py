"""SampleCache and CachedDataset: a PyTorch input pipeline's samples cached locally and on real donors,
shared by forked DataLoader workers and, by name and secret, by another job; faults lose nothing visible."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

from nodesvc.bus.procs import wait_until  # noqa: E402
from nodesvc.cli import status  # noqa: E402
from rdma.cache_manifest import ManifestError  # noqa: E402
from rdma.dataset import CachedDataset  # noqa: E402
from rdma.sample_cache import SampleCache  # noqa: E402
from rdma.sample_codec import encode  # noqa: E402
from tests.rdma.donors import SLAB  # noqa: E402

SECRET = "s3cret-for-tests-0001"


class Pipeline:
    """A deterministic 'decode and resize': sample i is the same tensor every time, plus its label."""

    def __init__(self, n: int, side: int = 24) -> None:
        self.n, self.side = n, side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return torch.rand(3, self.side, self.side, generator=g), i


def epoch(ds, workers: int, seed: int = 0) -> int:
    """One shuffled epoch; every sample must equal the uncached pipeline's, bit for bit."""
    ref = ds.dataset if isinstance(ds, CachedDataset) else ds
    seen = 0
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(seed))
    for x, y in loader:
        for k in range(len(y)):
            assert torch.equal(x[k], ref[int(y[k])][0]), int(y[k])
        seen += len(y)
    assert seen == len(ref)
    return seen


def test_workers_share_the_local_tier_and_the_next_epoch_hits():
    data = Pipeline(120)
    with SampleCache(len(data), local_bytes=4 << 20, local_segment_bytes=256 << 10) as cache:
        ds = CachedDataset(data, cache)
        epoch(ds, workers=2)  # workers compute and store
        st = cache.stats()
        assert st["misses"] == 120 and st["stores_local"] == 120 and st["entries"] == 120 and st["processes"] == 2  # the two workers
        epoch(ds, workers=2, seed=1)  # other workers, another order: all found
        epoch(ds, workers=0, seed=2)  # and in the main process
        st = cache.stats()
        assert st["hits_local"] == 240 and st["misses"] == 120 and st["corrupt"] == 0
        assert ds.computed == 0  # the main process computed nothing itself


def test_random_augmentation_runs_after_the_cache():
    data = Pipeline(10)
    with SampleCache(len(data), local_bytes=1 << 20) as cache:
        ds = CachedDataset(data, cache, after=lambda s: (s[0] + torch.rand(1), s[1]))
        a, b = ds[3][0], ds[3][0]
        assert not torch.equal(a, b) and cache.stats()["hits_local"] == 1


def test_a_full_cache_keeps_or_evicts_and_never_fails():
    data = Pipeline(64)
    entry = len(encode(data[0]))
    for mode in ("keep", "evict"):
        with SampleCache(len(data), local_bytes=32 * 64 * -(-entry // 64), local_segment_bytes=4 * 64 * -(-entry // 64),
                         when_full=mode) as cache:
            ds = CachedDataset(data, cache)
            epoch(ds, workers=0)
            epoch(ds, workers=0, seed=1)
            st = cache.stats()
            assert st["full"] > 0 if mode == "keep" else st["evicted_segments"] > 0
            assert 0 < st["entries"] <= 32 and st["hits_local"] > 0


def test_a_corrupted_entry_is_detected_and_computed_again():
    data = Pipeline(4)
    with SampleCache(len(data), local_bytes=1 << 20) as cache:
        ds = CachedDataset(data, cache)
        ds[2]
        rec = cache.state.read_slot(2)
        cache.state.local[int(rec["loff"]) + 100] ^= 0xFF
        assert torch.equal(ds[2][0], data[2][0])
        st = cache.stats()
        assert st["corrupt"] == 1 and st["misses"] == 2 and st["stores_local"] == 2
        assert torch.equal(ds[2][0], data[2][0]) and cache.stats()["hits_local"] == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="slots"):
        SampleCache(0, 1 << 20)
    with pytest.raises(ValueError, match="broker"):
        SampleCache(10, 0, 1 << 20)
    with pytest.raises(ValueError, match="secret"):
        SampleCache(10, 0, 1 << 20, broker="mqtt://127.0.0.1:1", name="x")
    with SampleCache(10, 1 << 16) as cache:
        with pytest.raises(IndexError):
            cache.get(10)
        with pytest.raises(TypeError, match="fork"):
            pickle.dumps(cache)


@pytest.mark.parametrize("workers", [0, 2])
def test_entries_spill_to_donors_and_survive_a_donor_kill(mosquitto, donor_factory, workers):
    donors = donor_factory(mosquitto.url, 3)
    data = Pipeline(160)  # ~7 kB a sample: 1.1 MB in all, local tier 256 kB
    with SampleCache(len(data), local_bytes=256 << 10, local_segment_bytes=64 << 10, remote_bytes=12 * SLAB,
                     broker=mosquitto.url, replicas=2, discover_timeout_s=20) as cache:
        ds = CachedDataset(data, cache)
        epoch(ds, workers)
        st = cache.stats()
        assert st["stores_remote"] > 100 and st["stores_local"] > 20 and st["entries"] == 160
        epoch(ds, workers, seed=1)
        assert cache.stats()["hits_remote"] >= st["stores_remote"]
        used = {c.addr for b in cache.keeper.segbufs.values() for e in b.extents for c in e.replicas}
        victim = next(d for d in donors if any(d.node == r.node for b in cache.keeper.segbufs.values()
                                               for r in b.extents[0].replicas))
        victim.kill9()  # mid-run: the next epoch reads the other copies
        epoch(ds, workers, seed=2)
        st2 = cache.stats()
        assert st2["misses"] == st["misses"] and st2["lost"] == 0, st2  # nothing recomputed: the copies held
        wait_until(lambda: cache.mem.stats["replicas_rebuilt"] > 0, 20, "the lost copies rebuilt")
        assert used


def test_entries_whose_every_copy_is_gone_are_computed_again(mosquitto, donor_factory):
    donors = donor_factory(mosquitto.url, 2)
    data = Pipeline(60)
    with SampleCache(len(data), local_bytes=0, remote_bytes=8 * SLAB, broker=mosquitto.url, replicas=1,
                     discover_timeout_s=20) as cache:
        ds = CachedDataset(data, cache)
        epoch(ds, 0)
        st0 = cache.state
        # the victim holds segments with entries in them (spare segments, mapped ahead, hold none)
        filled = {seg: b.extents[0].replicas[0].node for seg, b in cache.keeper.segbufs.items()
                  if np.count_nonzero(st0.slots["rseg"] == seg + 1)}
        victim = next(d for d in donors if d.node in filled.values())
        gone = {seg: int(st0.rgen[seg]) for seg, node in filled.items() if node == victim.node}
        victim.kill9()  # one copy a segment: its entries are gone
        wait_until(lambda: all(int(st0.rgen[seg]) != gen for seg, gen in gone.items()), 20,
                   "the keeper gives the lost segments up")
        epoch(ds, 2, seed=1)  # every sample still right: the lost ones computed again
        st = cache.stats()
        assert st["lost"] > 0 and st["misses"] == 60 + st["lost"], {k: v for k, v in st.items() if v}


def test_a_named_cache_is_shared_read_only_with_the_secret(mosquitto, donor_factory):
    donor_factory(mosquitto.url, 2)
    data = Pipeline(80)
    with SampleCache(len(data), local_bytes=128 << 10, local_segment_bytes=64 << 10, remote_bytes=16 * SLAB,
                     broker=mosquitto.url, name="pipeline-24", secret=SECRET, discover_timeout_s=20) as owner:
        epoch(CachedDataset(data, owner), 2)
        owner.flush()
        st = owner.stats()
        assert st["stores_remote"] == 80 and st["stores_local"] > 0  # every entry on donors, some local too
        with pytest.raises(ManifestError, match="secret"):
            SampleCache.attach("pipeline-24", "wrong-secret-0001", mosquitto.url)
        with pytest.raises(LookupError, match="no cache"):
            SampleCache.attach("nobody-fills-this", SECRET, mosquitto.url, timeout_s=0.5)
        with SampleCache.attach("pipeline-24", SECRET, mosquitto.url, reader_id="job-b") as reader:
            ds = CachedDataset(data, reader)
            epoch(ds, 2)  # the second job's first epoch: all from the donors
            rs = reader.stats()
            assert rs["hits_remote"] == 80 and rs["misses"] == 0 and rs["role"] == "reader"
            with pytest.raises(PermissionError):
                reader.put(0, b"x")
            wait_until(lambda: owner.stats()["readers"].get("job-b", {}).get("hits_remote") == 80, 10,
                       "the reader's hits reported to the owner")
        doc = status.summarize(asyncio.run(status.gather(mosquitto.url)))
        shown = next(c for c in doc["caches"] if c["cache"] == "pipeline-24")  # `dlshare status`, no secret needed
        assert shown["slots"] == 80 and shown["donor_bytes"] >= 2 * SLAB and shown["owner"] == owner.mem.consumer_id
    # the owner closed: its manifest is withdrawn
    with pytest.raises(LookupError):
        SampleCache.attach("pipeline-24", SECRET, mosquitto.url, timeout_s=0.5)


def test_one_line_from_the_node_daemons_budget(mosquitto, donor_factory, monkeypatch):
    donor_factory(mosquitto.url, 2)
    monkeypatch.setenv("DLSHARE_BROKER", mosquitto.url)
    monkeypatch.setenv("DLSHARE_REMOTE_MEMORY_BYTES", str(8 * SLAB))
    monkeypatch.setenv("DLSHARE_MEMORY_BYTES", str(1 << 20))
    monkeypatch.setenv("DLSHARE_NODE_ID", "gpu-node-3")
    data = Pipeline(30)
    with CachedDataset(data) as private:  # no address, no size in the job's code
        st = private.stats()
        assert st["local_bytes"] == 256 << 10 and 0 < st["remote_bytes"] <= 4 * SLAB  # a quarter; budget / copies
        assert private.cache.mem.consumer_id == "gpu-node-3"  # `dlshare status` counts it against the node
    with pytest.raises(LookupError, match="DLSHARE_CACHE_SECRET"):
        CachedDataset(data, "shared-30")
    monkeypatch.setenv("DLSHARE_CACHE_SECRET", SECRET)
    with CachedDataset(data, "shared-30") as first:
        epoch(first, 0)
        first.cache.flush()  # what it stored, on donors for others now (else within 50 ms)
        with CachedDataset(data, "shared-30") as second:  # the same name again: attaches, borrows nothing
            assert second.cache.read_only and second.cache.mem is None
            epoch(second, 0)
            assert second.stats()["hits_remote"] == 30 and second.computed == 0


def test_a_donor_reclaiming_mid_epoch_loses_nothing(mosquitto, donor_factory, control_factory, monkeypatch):
    donors = donor_factory(mosquitto.url, 2, deadline_s=10.0)
    ctl = control_factory(mosquitto.url)
    data = Pipeline(100)
    with SampleCache(len(data), local_bytes=0, remote_bytes=8 * SLAB, broker=mosquitto.url, replicas=1,
                     discover_timeout_s=20) as cache:
        # A copy is given back to its donor only once the readers' table no longer lists it: a reader
        # that finds it gone finds the table changed, and reads the new copy (the keeper's tick alone
        # could come late on a loaded machine, and the read would be a miss).
        given_back, still_listed = [], []
        unmap = cache.keeper.mem._unmap

        def checked_unmap(rep, wait=True):
            listed = {(c[0], c[1]) for cs in cache.state.read_table()[1].get("segments", {}).values() for c in cs}
            (still_listed if (rep.addr, rep.slab) in listed else given_back).append((rep.node, rep.slab))
            return unmap(rep, wait)

        monkeypatch.setattr(cache.keeper.mem, "_unmap", checked_unmap)
        ds = CachedDataset(data, cache)
        epoch(ds, 2)
        misses = cache.stats()["misses"]
        st0 = cache.state
        held = {d.node: sum(r.node == d.node for b in cache.keeper.segbufs.values() for r in b.extents[0].replicas)
                for d in donors}
        with_entries = {b.extents[0].replicas[0].node for seg, b in cache.keeper.segbufs.items()
                        if np.count_nonzero(st0.slots["rseg"] == seg + 1)}
        victim = max(with_entries, key=held.get)  # it holds entries: the reclaim moves them
        # Everything it lends, not the `held` counted above: the keeper maps spare segments as the stores
        # of the epoch land, and one granted by the victim whose answer had not reached the keeper yet
        # would be left out of a reclaim of `held` slabs, and kept (lending is paused, nothing else asks).
        res = ctl.call(victim, "reclaim", {"bytes": 64 * SLAB, "pause_s": 60.0})
        assert len(res["evicting"]) >= held[victim]
        epoch(ds, 2, seed=1)  # while the sole copies move to the other donor
        wait_until(lambda: ctl.call(victim, "donor_status", {})["slabs"] == [], 20, "the evicted slabs back")
        epoch(ds, 2, seed=2)
        st = cache.stats()
        assert st["misses"] == misses and st["lost"] == 0 and st["corrupt"] == 0, st  # nothing computed again
        assert not any(r.node == victim for b in cache.keeper.segbufs.values() for r in b.extents[0].replicas)
        assert not still_listed and any(node == victim for node, _ in given_back), (still_listed, given_back)


def test_lost_generations_are_told_from_recycled_ones():
    from rdma.cache_state import lost_at

    mask = (1 << 5) | (1 << 6)  # generations 5 and 6 ended with every copy lost; 4 was recycled
    assert lost_at(mask, 5, 7) and lost_at(mask, 6, 7)
    assert not lost_at(mask, 4, 7) and not lost_at(mask, 7, 7)  # recycled; current
    assert not lost_at(mask, 5, 5 + 65)  # too long ago to know: counted as recycled
