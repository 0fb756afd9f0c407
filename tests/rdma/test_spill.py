"""SpillCache: the local LRU alone, and spilling to real remote memory."""

from __future__ import annotations

import numpy as np

from rdma import SpillCache
from tests.rdma.donors import SLAB


def test_local_lru_without_remote_drops_the_oldest():
    c = SpillCache(capacity_bytes=100)
    for i in range(5):
        c.put(i, bytes([i]) * 30)
    assert c.stats.local_bytes <= 100
    assert 0 not in c and 1 not in c and c.get(4) == bytes([4]) * 30
    assert c.stats.dropped == 2
    c.get(2)  # 2 becomes the most recent
    c.put(9, b"x" * 30)
    assert 2 in c and 3 not in c
    del c[2]
    assert 2 not in c and c.get(2) is None and c.stats.misses == 1


def test_spills_to_remote_and_reads_back(mosquitto, donor_factory, consumer_factory):
    donor_factory(mosquitto.url, 2)
    rng = np.random.default_rng(5)
    values = {f"sample-{i}": rng.integers(0, 256, int(rng.integers(1, 20000)), dtype=np.uint8).tobytes()
              for i in range(300)}
    total = sum(map(len, values.values()))
    mem = consumer_factory(mosquitto.url, 2, replicas=2)
    with SpillCache(capacity_bytes=total // 5, remote=mem, arena_bytes=2 * SLAB) as cache:
        for k, v in values.items():
            cache.put(k, v)
        assert cache.stats.local_bytes <= total // 5
        assert cache.stats.spilled > 200 and cache.stats.dropped == 0
        assert sum(cache.where(k) == "remote" for k in values) > 200
        order = list(values)
        rng.shuffle(order)
        for k in order:
            assert cache.get(k) == values[k], k
        assert cache.stats.remote_hits > 200 and len(cache) == len(values)
        # overwrite and delete
        cache.put("sample-0", b"new")
        assert cache["sample-0"] == b"new"
        del cache["sample-1"]
        assert "sample-1" not in cache
        # a value bigger than the whole local tier goes straight to remote
        big = rng.integers(0, 256, total // 4, dtype=np.uint8).tobytes()
        cache.put("big", big)
        assert cache.where("big") == "remote" and cache.get("big") == big
        used = {r.node for a in cache._arenas for e in a.buf.extents for r in e.replicas}
        assert len(used) == 2


def test_remote_capacity_bound_drops_oldest_remote(mosquitto, donor_factory, consumer_factory):
    donor_factory(mosquitto.url, 2)
    mem = consumer_factory(mosquitto.url, 2, replicas=2)
    cache = SpillCache(capacity_bytes=0, remote=mem, arena_bytes=SLAB, remote_capacity_bytes=SLAB)
    page = b"p" * 4096
    for i in range(300):  # 300 pages into a 256-page arena
        cache.put(i, page)
    assert cache.stats.dropped == 44
    assert 0 not in cache and 299 in cache and cache.get(299) == page
    cache.close()
