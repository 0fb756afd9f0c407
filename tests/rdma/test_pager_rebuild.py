"""The region engine's rebuild of a lost copy (csrc/pager_io.c, pg_copy_extent) over C slab servers in this
process: every unit reaches the new copy, writes made meanwhile too, and a write-back of the extent waits
for the step being copied."""

from __future__ import annotations

import threading
import time

import numpy as np

from nodesvc.bus.procs import wait_until
from rdma.replica import REBUILDING, Replica
from tests.rdma.relay import HoldFirstBulkReply
from tests.rdma.regions import SLAB

UNIT = 64 << 10


def test_a_rebuilt_copy_gets_every_unit_and_the_writes_made_while_it_fills(local_cluster):
    region, io = local_cluster.region(SLAB, local_bytes=6 * UNIT, replicas=2)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    ext = region.buffer.extents[0]
    # as RemoteMemory._repair does: the new copy joins as REBUILDING (writes reach it), then fills
    rebuilding = local_cluster.slab(2, initial=REBUILDING)
    with ext.lock:
        ext.replicas.append(rebuilding)
        region.buffer.replicas_changed(ext)
    stop = threading.Event()

    def writer() -> None:
        k = 0
        while not stop.is_set():
            a[(k * 4099) % len(a)] += 1  # dirty units keep being written back while the copy fills
            k += 1

    t = threading.Thread(target=writer)
    t.start()
    copied = region.buffer.rebuild_into(ext, rebuilding, None)
    stop.set()
    t.join()
    assert copied is not None
    region.flush()
    want = np.array(a)
    got = local_cluster.read_copy(rebuilding, SLAB).view(np.uint32)
    assert np.array_equal(got, want)
    assert not io.failed


def test_a_write_back_waits_for_the_rebuild_step_of_its_extent_and_the_wait_is_counted(local_cluster):
    """No write-back of an extent lands between a rebuild step's read and its write (the step holds the
    extent's write-back lock across both), and the time write-backs spend waiting for that lock is the
    ``writeback_lock_wait_ns`` stat.  Here the new copy holds its reply to the first step's write for
    2 s, and a flush made meanwhile ends only after the reply is passed on; the new copy still gets
    every unit and the write."""
    slab = 2 << 20  # two rebuild steps of 16 units of 64 KiB
    region, io = local_cluster.region(slab, local_bytes=2 * slab, unit=UNIT, slab=slab)  # nothing to evict
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    region.flush()  # every unit written to both copies: the rebuild copies all of them
    ext = region.buffer.extents[0]
    new = local_cluster.slab(2, slab, initial=REBUILDING)
    relay = HoldFirstBulkReply(new.addr, 2.0)
    rebuilding = Replica(new.node, relay.addr, new.slab, new.token, new.slab_bytes, REBUILDING)
    with ext.lock:
        ext.replicas.append(rebuilding)
        region.buffer.replicas_changed(ext)
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(region.buffer.rebuild_into(ext, rebuilding, None)))
    try:
        t.start()
        assert relay.holding.wait(30), "the rebuild's first step never reached the new copy"
        a[5] += 1
        waited = region.stats()["writeback_lock_wait_ns"]
        region.flush()  # unit 5 is dirty; the first step's write is held at the new copy
        flushed_at = time.monotonic()
        assert relay.released_at is not None and flushed_at >= relay.released_at, \
            "the flush ended while the rebuild step's write was still held"
        assert region.stats()["writeback_lock_wait_ns"] > waited
        t.join(60)
        assert done and done[0] is not None
        assert np.array_equal(local_cluster.read_copy(new, slab).view(np.uint32), np.array(a))
        assert not io.failed
    finally:
        t.join(60)
        relay.close()


def _joined_copy(local_cluster, slab: int):
    """A region of one extent whose every unit holds data on both copies, and a third copy joined as
    REBUILDING (as RemoteMemory._repair does before it fills it)."""
    region, io = local_cluster.region(slab, local_bytes=2 * slab, unit=UNIT, slab=slab)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    region.flush()
    ext = region.buffer.extents[0]
    new = local_cluster.slab(2, slab, initial=REBUILDING)
    with ext.lock:
        ext.replicas.append(new)
        region.buffer.replicas_changed(ext)
    return region, io, a, ext, new


def test_a_paced_rebuild_copies_no_faster_than_its_cap_and_copies_everything(local_cluster):
    """``bytes_per_s`` (RemoteMemory's ``rebuild_bytes_per_s``): after each 1 MiB step the rebuild
    waits until the bytes copied so far are due at the cap, so 4 MiB at 2 MiB/s take at least 2 s."""
    slab = 4 << 20
    region, io, a, ext, new = _joined_copy(local_cluster, slab)
    t0 = time.monotonic()
    copied = region.buffer.rebuild_into(ext, new, None, bytes_per_s=2 << 20)
    took = time.monotonic() - t0
    assert copied == slab
    assert took >= 1.95, f"4 MiB at 2 MiB/s copied in {took:.2f} s"
    assert np.array_equal(local_cluster.read_copy(new, slab).view(np.uint32), np.array(a))
    assert not io.failed


def test_a_paced_rebuild_stops_when_its_region_closes(local_cluster):
    """A close does not wait out the pacing: 8 MiB at 512 KiB/s would take 14 s; the rebuild fails
    (the caller drops the new copy) soon after the close instead."""
    slab = 8 << 20
    region, io, a, ext, new = _joined_copy(local_cluster, slab)
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(region.buffer.rebuild_into(ext, new, None, bytes_per_s=512 << 10)))
    t.start()
    try:
        # both copies' flush, then the rebuild's first step
        wait_until(lambda: region.stats()["bytes_written"] >= slab * 2 + (1 << 20), 30,
                   "the paced rebuild's first step")
        region.close()
        t.join(5)
        assert not t.is_alive(), "the paced rebuild outlived its region's close by 5 s"
        assert done == [None]
    finally:
        t.join(60)


def test_a_rebuild_copies_the_units_this_process_holds_from_its_own_memory(local_cluster):
    """Units resident in the job (clean, or dirty with newer bytes) go to the new copy from the job's own
    memory; only the others are read from a surviving copy, so the survivors serve exactly the bytes the
    job does not hold.  After the dirty units' write-back the new copy equals the region."""
    slab = 4 << 20
    region, io = local_cluster.region(slab, local_bytes=slab // 2, unit=UNIT, slab=slab)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    region.flush()  # every unit has data on both copies; half of them stay resident
    a[::len(a) // 64] += 7  # some resident units now dirty, with bytes newer than their copies'
    ext = region.buffer.extents[0]
    survivors = [(local_cluster.servers[int(r.node[1:])], r.slab) for r in ext.replicas]
    served0 = sum(s.slab_stats(sid).bytes_read for s, sid in survivors)
    new = local_cluster.slab(2, slab, initial=REBUILDING)
    with ext.lock:
        ext.replicas.append(new)
        region.buffer.replicas_changed(ext)
    before = region.stats()["rebuild_resident_bytes"]
    assert region.buffer.rebuild_into(ext, new, None) == slab
    from_memory = region.stats()["rebuild_resident_bytes"] - before
    served = sum(s.slab_stats(sid).bytes_read for s, sid in survivors) - served0
    assert from_memory >= slab // 4, f"only {from_memory} bytes of a half-resident {slab} came from memory"
    assert served == slab - from_memory
    region.flush()
    assert np.array_equal(local_cluster.read_copy(new, slab).view(np.uint32), np.array(a))
    assert not io.failed
