"""The region engine (csrc/pager*.c) over C slab servers in this process: faults, eviction, write-back,
races, failover, lost units, close (rebuilds: test_pager_rebuild.py).  The same against donor processes is test_region.py."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from nodesvc.bus.procs import wait_until
from rdma import wire
from rdma.errors import RemoteMemoryError
from rdma.native import ffi, lib
from rdma.region_engine import _STATS, UNIT_STATES
from rdma.replica import REBUILDING
from tests.rdma.donors import ROOT
from tests.rdma.regions import SLAB

UNIT = 64 << 10


# --- the sequential detector (pure C) -------------------------------------------------------------

def trend_run(faults, max_depth=16):
    t = ffi.new("dls_trend *")
    lib.dls_trend_init(t)
    first, stride = ffi.new("int64_t *"), ffi.new("int64_t *")
    out = []
    for u in faults:
        n = lib.dls_trend_fault(t, u, max_depth, first, stride)
        out.append([first[0] + stride[0] * i for i in range(n)])
    return out


def test_trend_finds_a_stream_after_two_equal_deltas_and_runs_further_ahead():
    asked = trend_run([10, 11, 12])
    assert asked[:2] == [[], []]
    assert asked[2] == [13, 14]  # two deltas of +1: a stream, two units ahead
    # the stream goes on (a fault at the end of what was asked): the depth doubles, nothing asked twice
    asked = trend_run([10, 11, 12, 15, 19, 27])
    assert asked[3] == [16, 17, 18, 19] and asked[4] == [20, 21, 22, 23, 24, 25, 26, 27]
    flat = [u for a in asked for u in a]
    assert len(flat) == len(set(flat))
    # a fault on every unit (prefetches arriving late): the stream keeps max_depth units ahead
    asked = trend_run(range(0, 200), max_depth=16)
    ahead = [max(u for a in asked[: k + 1] for u in a) - k for k in range(20, 200)]
    assert set(ahead) == {16}


def test_trend_follows_strides_and_descending_scans_and_ignores_random_faults():
    assert trend_run([100, 98, 96])[2] == [94, 92]
    assert trend_run([50, 49, 48])[2] == [47, 46]
    rng = np.random.default_rng(0)
    assert sum(len(a) for a in trend_run(rng.integers(0, 1 << 30, 200).tolist())) == 0
    assert trend_run([0, 100, 200])[2] == []  # a stride too large to be a stream
    # majority vote: one odd delta among equal ones still shows the trend
    t = ffi.new("dls_trend *")
    lib.dls_trend_init(t)
    f, s = ffi.new("int64_t *"), ffi.new("int64_t *")
    for u in (1, 2, 3, 9, 10):
        lib.dls_trend_fault(t, u, 0, f, s)
    assert lib.dls_trend_majority(t, 2) == 0  # deltas 6, 1: no majority in the last two...
    assert lib.dls_trend_majority(t, 4) == 1  # ...the window doubles: 1, 1, 6, 1
    lib.dls_trend_init(t)
    for u in (1, 5, 2, 8):
        lib.dls_trend_fault(t, u, 0, f, s)
    assert lib.dls_trend_majority(t, 4) == 0


def test_trend_forgets_a_left_streams_faults_when_it_looks_for_the_next():
    """Inside a running stream the faults land where its prefetch runs end (every 8 units for 16 KiB
    units and 128 KiB runs), a spacing that says nothing of how the program reads.  A reader that
    jumps elsewhere and reads on in order must get a stream of stride 1, not one of stride 8 that
    prefetches every eighth unit while it faults on each of the others (found in the paging bench's
    stream at 16 KiB units: a whole 4 MiB chunk fetched on demand, unit by unit)."""
    old = [1000 + 8 * k for k in range(12)]  # a stream's faults, 8 units apart, depth 64
    asked = trend_run([1000, 1001, 1002] + old[1:] + [5000, 5001, 5002, 5003], max_depth=64)
    assert asked[2] == list(range(1003, 1011))  # the first stream, stride 1
    jump = asked[-4:]
    assert jump[:2] == [[], []]
    assert jump[2][:2] == [5003, 5004]  # stride 1, found at the third fault as a fresh detector finds it
    assert all(b - a == 1 for run in jump for a, b in zip(run, run[1:]))


# --- faults, eviction, write-back -----------------------------------------------------------------

@pytest.mark.parametrize("policy,unit", [("clock", 64 << 10), ("fifo", 16 << 10), ("random", 4 << 10)])
def test_data_survives_eviction_under_every_policy(local_cluster, policy, unit):
    region, io = local_cluster.region(4 * SLAB, local_bytes=SLAB // 2, unit=unit, policy=policy)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 1 << 62, region.nbytes // 8, dtype=np.uint64)
    a = region.array(np.uint64)
    a[:] = data  # 4x the budget: most of it is written back and evicted on the way
    assert np.array_equal(a, data)
    st = region.stats()
    assert st["resident_units"] <= st["local_units"] and st["over_budget"] == 0
    assert st["evicted_dirty"] > 0 and st["written_back_units"] > 0 and st["fetched_units"] > 0
    # random single-element updates: a fault, then a write fault on the clean unit
    idx = rng.integers(0, len(data), 3000)
    for i in idx:
        a[i] += 1
    np.add.at(data, idx, np.uint64(1))  # (a Python 1 would go through float64)
    assert np.array_equal(a, data)
    assert region.stats()["faults_wp"] > 0
    # the evictors go back to sleep only once the resident count is under their high mark
    wait_until(lambda: region.stats()["evictors_idle"], 30, "the evictors to go idle")
    st = region.stats()
    assert st["resident_units"] <= st["local_units"] - max(1, st["local_units"] // 32), st
    region.flush()
    # every copy holds the data now, straight from the servers
    for ext in region.buffer.extents:
        lo = ext.first_page * 4096
        want = data.view(np.uint8)[lo:lo + ext.npages * 4096]
        for rep in ext.replicas:
            assert np.array_equal(local_cluster.read_copy(rep, ext.npages * 4096), want), (ext.index, rep.node)
    assert not io.failed


def test_never_written_units_are_zeros_without_a_fetch(local_cluster):
    region, _ = local_cluster.region(2 * SLAB, local_bytes=SLAB)
    a = region.array(np.float32, (2 * SLAB // 4,))
    assert float(a[:1000].sum()) == 0.0 and float(a[-5:].sum()) == 0.0
    st = region.stats()
    assert st["fetched_units"] == 0 and st["zero_units"] >= 2


def test_a_sequential_scan_is_detected_and_fetched_ahead(local_cluster):
    """How far ahead it runs depends on how fast the workers are (bench/paging.py measures that);
    here: the stream is seen, units are asked for before their fault, and the data is right."""
    region, _ = local_cluster.region(4 * SLAB, local_bytes=SLAB, prefetch_bytes=SLAB // 2)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    region.flush()
    before = region.stats()
    assert int(a.astype(np.uint64).sum()) == int(np.arange(len(a), dtype=np.uint64).sum())
    st = region.stats()
    assert st["prefetched_units"] > before["prefetched_units"]
    assert st["fetched_units"] - before["fetched_units"] >= 3 * SLAB // UNIT  # all but the resident part


def test_a_stream_the_reader_leaves_gives_up_what_no_worker_started(local_cluster):
    """One fetch worker, held 0.3 s in each install: a stream's first run is in its hands and the
    rest of what the stream asked for waits in the queue.  The reader jumps elsewhere: the waiting
    units go back to absent, nothing fetches them, and the data the reader touches is right."""
    unit = 4096
    region, _ = local_cluster.region(8 * SLAB, local_bytes=2 * SLAB, unit=unit, fetch_workers=1,
                                     prefetch_bytes=SLAB // 2)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32) + 1
    region.flush()
    region.prefetch(6 * SLAB, 2 * SLAB)  # the first six extents go out of memory
    per = unit // 4
    start = SLAB // unit  # unit 256: the second extent, absent
    assert region.unit_state(start + 40) == "absent"
    region._engine.set_install_delay(300_000, streams_only=True)

    def waiting() -> int:  # units asked for and not in yet: more than one run means some wait in the queue
        return sum(region.unit_state(v) == "fetching" for v in range(start, start + 256))

    u = start
    while waiting() <= 40:  # a stream: its detector asks further ahead at each fault (runs of 32 units)
        assert int(a[u * per]) == u * per + 1
        u += 1
        assert u < start + 200, "the stream never ran two runs ahead"
    far = 4 * SLAB // unit + 100  # the reader leaves for another part of the region
    for v in (far, far + 57, far + 13):
        assert int(a[v * per]) == v * per + 1
    st = region.stats()
    assert st["stream_cancelled"] > 0, st
    region._engine.set_install_delay(0)
    wait_until(lambda: "fetching" not in {region.unit_state(u) for u in range(start, start + 256)}, 30,
               "the stream's runs in flight to land")
    states = [region.unit_state(u) for u in range(start, start + 256)]
    assert "absent" in states[u - start:], states  # given up, not fetched
    assert np.array_equal(a[start * per:(start + 256) * per],
                          np.arange(start * per, (start + 256) * per, dtype=np.uint32) + 1)


def test_a_scan_larger_than_memory_keeps_what_was_resident_and_evicts_what_it_read(local_cluster):
    """A stream's units are evicted as soon as the reader is past them, most recently read first,
    before anything that was resident when the scan began: a sequential pass over four times the
    budget that starts with the last quarter resident hits it when it gets there.  FIFO or LRU would
    have evicted that quarter to make room for the first three, and fetched all four."""
    unit = 4096
    region, _ = local_cluster.region(4 * SLAB, local_bytes=SLAB, unit=unit, prefetch_bytes=64 << 10)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    region.flush()
    region.prefetch(3 * SLAB, SLAB)  # the last quarter resident
    units = 4 * SLAB // unit
    before = region.stats()
    assert int(a.sum(dtype=np.uint64)) == int(np.arange(len(a), dtype=np.uint64).sum())  # one pass, in order
    fetched = region.stats()["fetched_units"] - before["fetched_units"]
    assert fetched < units * 7 // 8, fetched  # most of the last quarter was a hit
    last = range(3 * units // 4, units)
    assert sum(region.unit_state(u) in ("clean", "dirty") for u in last) > len(last) // 2


def moves_here() -> bool:
    """Whether this kernel lets the engine move dirty victims out (UFFDIO_MOVE, Linux 6.8+)."""
    cfg = ffi.new("dls_pager_config *", {"nbytes": 1 << 20, "unit": 4096, "local_bytes": 1 << 18, "policy": 1,
                                         "fetch_workers": 1, "evict_threads": 1, "nextents": 1})
    err, out = ffi.new("char[256]"), ffi.new("dls_pager **")
    assert lib.dls_pager_create(cfg, out, err, 256) == 0, ffi.string(err)
    st = ffi.new("dls_pager_stats *")
    lib.dls_pager_get_stats(out[0], st)
    lib.dls_pager_free(out[0])
    return bool(st.move_evict)


@pytest.mark.parametrize("move_evict", [True, False], ids=["moved-out", "protected-in-place"])
def test_concurrent_writers_racing_write_back_and_eviction_lose_nothing(local_cluster, move_evict):
    """Writes land while their units are written back or evicted, faults hit units on their way out,
    with dirty victims moved out of the mapping for their write-back and with them write-protected in place."""
    if move_evict and not moves_here():
        pytest.skip("this kernel has no UFFDIO_MOVE (Linux 6.8+): dirty victims are write-protected in place")
    region, io = local_cluster.region(4 * SLAB, local_bytes=12 * UNIT, policy="clock", fetch_workers=3,
                                      move_evict=move_evict)
    a = region.array(np.int64)
    n_threads, rounds, span = 4, 300, 2048  # slices big enough that numpy drops the GIL
    errors = []

    def writer(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            for _ in range(rounds):
                i = int(rng.integers(0, len(a) // n_threads - span)) * n_threads + k
                a[i:i + span * n_threads:n_threads] += 1  # each thread its own elements
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    flusher_stop = threading.Event()

    def flusher() -> None:  # flushes racing eviction and the writers
        while not flusher_stop.is_set():
            region.flush()

    f = threading.Thread(target=flusher)
    f.start()
    for t in threads:
        t.join()
    flusher_stop.set()
    f.join()
    assert not errors
    want = np.zeros(len(a), np.int64)
    for k in range(n_threads):
        rng = np.random.default_rng(k)
        for _ in range(rounds):
            i = int(rng.integers(0, len(a) // n_threads - span)) * n_threads + k
            want[i:i + span * n_threads:n_threads] += 1
    got = np.array(a)
    bad = np.flatnonzero(got != want)
    assert not len(bad), (len(bad), np.unique(bad * 8 // UNIT)[:20], np.unique(got[bad] - want[bad]), region.stats())
    st = region.stats()
    assert st["evicted_dirty"] > 0 and st["faults_wp"] > 0 and st["units_lost"] == 0 and not io.failed
    assert st["move_evict"] == int(move_evict) and (st["evicted_moved"] > 0) == move_evict, st
    assert st["engine_errors"] == 0, region.engine_errors()


@pytest.mark.parametrize("move_evict", [True, False], ids=["moved-out", "protected-in-place"])
def test_scattered_rows_updated_by_threads_while_evicted_keep_every_update(local_cluster, move_evict):
    """An embedding table's pattern: threads add to scattered 4 KiB units, each asking for its next rows
    ahead for writing (as rdma.torch.prefetch_lookups does), so units are touched and prefetched while the
    evictor takes them out; every update must be in the region and on every copy after a flush."""
    if move_evict and not moves_here():
        pytest.skip("this kernel has no UFFDIO_MOVE (Linux 6.8+)")
    region, io = local_cluster.region(4 * SLAB, local_bytes=64 * 4096, unit=4096, policy="clock",
                                      move_evict=move_evict)
    a = region.array(np.int64)
    per_unit = 4096 // 8
    n_units = region.nbytes // 4096
    n_threads, steps, rows = 3, 60, 96
    errors = []

    def plan(k: int) -> list[np.ndarray]:
        rng = np.random.default_rng(100 + k)
        # each thread its own units (k mod n_threads): no two threads add to the same element
        return [rng.choice(np.arange(k, n_units, n_threads), rows, replace=False) for _ in range(steps)]

    def trainer(k: int) -> None:
        try:
            batches = plan(k)
            for s, units in enumerate(batches):
                if s + 1 < steps:
                    region.prefetch_units(batches[s + 1], write=True, timeout=None)
                for u in units:
                    a[int(u) * per_unit + (s % per_unit)] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    want = np.zeros(len(a), np.int64)
    for k in range(n_threads):
        for s, units in enumerate(plan(k)):
            want[units * per_unit + (s % per_unit)] += 1
    got = np.array(a)
    assert np.array_equal(got, want), (np.count_nonzero(got != want), region.stats())
    region.flush()
    for ext in region.buffer.extents:
        lo = ext.first_page * 4096
        for rep in ext.replicas:
            copy = local_cluster.read_copy(rep, ext.npages * 4096)
            assert np.array_equal(copy, want.view(np.uint8)[lo:lo + ext.npages * 4096]), (ext.index, rep.node)
    st = region.stats()
    assert st["evicted_dirty"] > 100 and st["units_lost"] == 0 and not io.failed and st["engine_errors"] == 0
    assert (st["evicted_moved"] > 100) == move_evict, st


def test_prefetch_for_writing_installs_units_dirty_without_write_faults(local_cluster):
    region, _ = local_cluster.region(2 * SLAB, local_bytes=SLAB)
    units = np.arange(0, 8)
    assert region.prefetch_units(units, write=True) == 0
    assert {region.unit_state(int(u)) for u in units} == {"dirty"}
    a = region.array(np.uint8, 8 * UNIT, offset=0)
    wp = region.stats()["faults_wp"]
    a[:] = 7
    assert region.stats()["faults_wp"] == wp


def test_a_thread_woken_from_a_fault_finds_its_unit_settled(local_cluster):
    """The engine maps a fetched unit in, settles its state, and only then wakes the threads that
    faulted on it.  Until the wake came last, UFFDIO_COPY itself woke them: a thread that faulted
    on a unit could run on while the unit was still "fetching".  The engine's install_delay_us
    widens that window to 100 ms here, so the old order fails every time.  (A thread that touches
    a unit after its copy and before its state settles takes no fault at all: for it the state
    lags the bytes by that window, which is why tests that look at states wait for them to settle.)"""
    region, _ = local_cluster.region(2 * SLAB, local_bytes=8 * UNIT, prefetch_bytes=0)
    a = region.array(np.uint64)
    a[:] = np.arange(len(a), dtype=np.uint64) + 0x5A5A
    region.flush()
    region.prefetch(SLAB, SLAB)  # the first extent goes out of memory
    per_unit = UNIT // 8
    gone = [u for u in range(SLAB // UNIT) if region.unit_state(u) == "absent"]
    assert len(gone) >= 2, [region.unit_state(u) for u in range(SLAB // UNIT)]
    read_u, write_u = gone[0], gone[-1]
    region._engine.set_install_delay(100_000)
    assert int(a[read_u * per_unit + 3]) == read_u * per_unit + 3 + 0x5A5A  # a read fault: installed clean
    assert region.unit_state(read_u) == "clean"
    a[write_u * per_unit] = 1  # a write fault: installed writable
    assert region.unit_state(write_u) == "dirty"


# --- copies failing, lost, rebuilt -------------------------------------------------------------------

def test_reads_fail_over_when_a_copy_server_stops(local_cluster):
    region, io = local_cluster.region(3 * SLAB, local_bytes=8 * UNIT)
    a = region.array(np.uint16)
    a[:] = np.arange(len(a), dtype=np.uint16)
    region.flush()
    region.prefetch(2 * SLAB, SLAB)  # the first extents go out of memory
    local_cluster.stop(0)
    assert np.array_equal(a, np.arange(len(a), dtype=np.uint16))
    assert region.stats()["failovers"] >= 1
    wait_until(lambda: io.failed, 10, "the engine's events")
    assert {node for _, node, _ in io.failed} == {"s0"}
    # the engine no longer uses the lost copies: a second pass fails nothing new
    n = len(io.failed)
    region.prefetch(2 * SLAB, SLAB)
    assert np.array_equal(a[: SLAB // 2], np.arange(SLAB // 2, dtype=np.uint16))
    assert len(io.failed) == n


def test_a_corrupt_copy_is_caught_by_the_unit_checksum(local_cluster):
    region, io = local_cluster.region(SLAB, local_bytes=4 * UNIT, replicas=2)
    a = region.array(np.uint8)
    a[:] = 5
    region.flush()
    region.prefetch(SLAB // 2, SLAB // 2)
    ext = region.buffer.extents[0]
    bad = ext.replicas[0]  # the engine reads copy (extent + unit) % 2 first: unit 0 -> this one
    from rdma.endpoint import Endpoint

    host, _, port = bad.addr.rpartition(":")
    with Endpoint(host, int(port)) as ep:
        ep.write(bad.slab, bad.token, [0], [UNIT], np.zeros(UNIT, np.uint8))
    assert int(a[:UNIT].min()) == 5  # served by the other copy
    assert region.stats()["copy_failures"] == 1 and region.stats()["failovers"] == 1
    wait_until(lambda: io.failed, 10, "the engine's event")
    assert [(i, node) for i, node, _ in io.failed] == [(0, bad.node)]
    assert io.failed[0][2].code == wire.E_CRC


def test_read_raises_and_touch_is_sigbus_when_every_copy_is_gone():
    out = subprocess.run([sys.executable, "-m", "tests.rdma.region_child", "lost", "-"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert "state absent" in lines, out.stdout + out.stderr
    assert any(line.startswith("read raised DataLostError") for line in lines), out.stdout + out.stderr
    assert lines[-1] == "touching" and out.returncode == -signal.SIGBUS, (out.returncode, out.stdout, out.stderr)


def test_a_clean_unit_whose_every_copy_is_gone_stays_resident_and_intact(local_cluster):
    """Once every copy of an extent has failed, its resident units hold the last of its data: the
    evictor must keep the clean ones (dropping one would turn readable bytes into a lost unit), as it
    keeps dirty ones that no copy took.  Here both servers stop, a failed flush makes the engine see
    it, and then more units than the budget are written: only two clean units that hold no data (they
    come back as zeros) can be evicted, a fault goes over budget, and the six clean units are still
    resident, with their bytes."""
    slab = 2 * SLAB  # one extent of 32 units
    region, io = local_cluster.region(slab, local_bytes=16 * UNIT, unit=UNIT, slab=slab)
    a = region.array(np.uint8)
    clean = [3, 0, 5, 1, 4, 2]  # no two equal steps: no stream is detected, nothing is fetched ahead
    for u in clean:
        a[u * UNIT:(u + 1) * UNIT] = u + 1
    region.flush()
    assert [region.unit_state(u) for u in range(6)] == ["clean"] * 6
    local_cluster.stop(0)
    local_cluster.stop(1)
    a[6 * UNIT] = 7  # dirty: its write-back tells the engine that both copies are gone
    with pytest.raises(RemoteMemoryError):
        region.flush()
    wait_until(lambda: len(io.failed) == 2, 10, "both copies reported failed")
    assert int(a[12 * UNIT]) == int(a[15 * UNIT]) == 0  # never written: clean zeros, no data to lose
    for u in (20, 8, 27, 11, 30, 14, 23, 9, 25, 17):  # 19 units against a budget of 16 (never written: no fetch)
        a[u * UNIT] = 9
    assert region.stats()["over_budget"] >= 1  # the evictor was asked for room and found too little
    assert [region.unit_state(u) for u in range(6)] == ["clean"] * 6  # only then is reading them safe
    wait_until(lambda: region.unit_state(12) == region.unit_state(15) == "absent", 10,
               "the zero units dropped (a touch gives zeros again)")
    for u in range(6):
        assert int(a[u * UNIT:(u + 1) * UNIT].min()) == int(a[u * UNIT:(u + 1) * UNIT].max()) == u + 1


def test_an_extent_that_lost_every_copy_keeps_its_resident_units_on_a_new_copy(local_cluster):
    """Salvage (RemoteMemory's repair when no copy is left): the units that were only on the lost
    copies are lost at once, before the new copy can be read, and every resident unit with data goes
    dirty, so that its write-back fills the new copy; after a flush and an eviction they read back
    right from it, and a rebuild from it to a further copy copies only what it holds."""
    slab = 2 * SLAB  # one extent of 32 units
    region, io = local_cluster.region(slab, local_bytes=16 * UNIT, unit=UNIT, slab=slab)
    a = region.array(np.uint8)
    for u in [3, 0, 5, 1, 4, 2, 9, 7]:  # no stream: nothing is fetched ahead
        a[u * UNIT:(u + 1) * UNIT] = u + 1
    region.flush()
    written = [0, 1, 2, 3, 4, 5, 7, 9]
    region.prefetch(16 * UNIT, 8 * UNIT)  # never-written units: installed as zeros, and the oldest leave

    def settled() -> bool:  # some written unit evicted, and nothing on its way
        states = [region.unit_state(u) for u in range(32)]
        return "absent" in [states[u] for u in written] and not {"evicting", "writeback", "fetching"} & set(states)

    wait_until(settled, 10, "the evictor to settle")
    resident = [u for u in written if region.unit_state(u) == "clean"]
    gone = [u for u in written if region.unit_state(u) == "absent"]
    assert gone and resident, (resident, gone)
    ext = region.buffer.extents[0]
    with pytest.raises(TimeoutError):  # both copies are still durable
        region.buffer.salvage(ext, 1.0)
    local_cluster.stop(0)
    local_cluster.stop(1)
    a[resident[0] * UNIT] += 100  # a dirty unit: its write-back fails on both copies
    with pytest.raises(RemoteMemoryError):
        region.flush()
    wait_until(lambda: len(io.failed) == 2, 10, "both copies reported failed")
    kept = region.buffer.salvage(ext, 10.0)
    assert kept == len(resident)
    assert [region.unit_state(u) for u in gone] == ["lost"] * len(gone)
    assert all(region.unit_state(u) == "dirty" for u in resident)
    new = local_cluster.slab(2, slab)
    with ext.lock:
        ext.replicas.append(new)
        region.buffer.replicas_changed(ext)
    region.flush()  # the kept units reach the new copy
    want = {u: np.array(a[u * UNIT:(u + 1) * UNIT]) for u in resident}
    on_new = local_cluster.read_copy(new, slab)
    for u, b in want.items():
        assert np.array_equal(on_new[u * UNIT:(u + 1) * UNIT], b)
    region.prefetch(10 * UNIT, 6 * UNIT)  # they leave memory, and come back from the new copy
    region.prefetch(24 * UNIT, 8 * UNIT)
    wait_until(lambda: any(region.unit_state(u) == "absent" for u in resident), 10, "a kept unit evicted")
    fails = region.stats()["copy_failures"]
    for u, b in want.items():
        assert np.array_equal(np.array(a[u * UNIT:(u + 1) * UNIT]), b)
    assert region.stats()["copy_failures"] == fails  # every fetched unit matched its checksum
    third = local_cluster.slab(2, slab, initial=REBUILDING)
    with ext.lock:
        ext.replicas.append(third)
        region.buffer.replicas_changed(ext)
    assert region.buffer.rebuild_into(ext, third, None) is not None  # nothing lost is asked for
    assert region.stats()["copy_failures"] == fails


# --- fork and close ----------------------------------------------------------------------------------

def test_a_forked_child_has_no_mapping_and_the_parent_is_unharmed(local_cluster):
    region, _ = local_cluster.region(2 * SLAB, local_bytes=8 * UNIT)
    a = region.array(np.uint32)
    a[:] = np.arange(len(a), dtype=np.uint32)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, no pytest
        faulthandler.disable()  # the SIGSEGV below is expected: no traceback on the test's stderr
        os.close(r)
        try:
            region.array(np.uint8, 16)
            os.write(w, b"array() worked\n")
        except RuntimeError:
            os.write(w, b"array() raised\n")
        os.write(w, b"touching\n")
        os.write(w, str(int(a[len(a) - 1])).encode() + b"\n")  # SIGSEGV: no mapping here (MADV_DONTFORK)
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    said = os.read(r, 4096).decode().split()
    os.close(r)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, (status, said)
    assert said == ["array()", "raised", "touching"]
    assert np.array_equal(a, np.arange(len(a), dtype=np.uint32))  # the parent reads on, from its copies too
    region.flush()


def test_close_frees_the_memory_and_keeps_the_range_reserved(local_cluster):
    region, io = local_cluster.region(2 * SLAB, local_bytes=8 * UNIT)
    a = region.array(np.uint8)
    a[:] = 1
    region.close()
    assert region.closed and io.released == 1
    for call in (lambda: region.array(np.uint8, 4), region.flush, lambda: region.prefetch(0, 10)):
        with pytest.raises(ValueError, match="closed"):
            call()
    region.close()  # twice is fine
    with open("/proc/self/maps") as fh:  # still reserved, inaccessible, while `a` lives
        start = f"{region.address:x}"
        line = next(x for x in fh if x.startswith(start))
    assert line.split()[1].startswith("---p")
    del a


def test_closing_while_threads_touch_it_is_sigsegv_never_wrong_bytes():
    out = subprocess.run([sys.executable, "-m", "tests.rdma.region_child", "close", "-"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "closing after" in out.stdout and "WRONG" not in out.stdout, out.stdout + out.stderr
    assert "survived" not in out.stdout
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)


def test_closing_while_the_engine_writes_back_is_safe():
    for _ in range(3):  # the engine's own threads never touch the range after it is made PROT_NONE
        out = subprocess.run([sys.executable, "-m", "tests.rdma.region_child", "close-busy", "-"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == ["closed", "survived"], (out.returncode, out.stdout,
                                                                                    out.stderr)


def test_bad_geometry_is_refused_with_a_reason(local_cluster):
    with pytest.raises(ValueError, match="multiple of 4096"):
        local_cluster.region(SLAB, local_bytes=SLAB, unit=5000)
    with pytest.raises(ValueError, match="at least 4 units"):
        local_cluster.region(SLAB, local_bytes=UNIT, unit=UNIT)
    with pytest.raises(ValueError, match="not a multiple of the unit"):
        local_cluster.region(SLAB, local_bytes=SLAB, unit=3 * 4096 * 16)
    with pytest.raises(ValueError, match="policy"):
        local_cluster.region(SLAB, local_bytes=SLAB, policy="lru")
    with pytest.raises(OSError, match="fault_threads must be 0..16"):
        local_cluster.region(SLAB, local_bytes=SLAB, fault_threads=17)
    with pytest.raises(OSError, match="spin_us must be at most 10000"):
        local_cluster.region(SLAB, local_bytes=SLAB, spin_us=20000)
    # one fault thread, no polling: still a working region
    region, _ = local_cluster.region(SLAB, local_bytes=SLAB // 2, fault_threads=1, spin_us=0, fetch_workers=1)
    a = region.array(np.uint16)
    a[:] = np.arange(len(a), dtype=np.uint16)
    region.flush()
    region.prefetch(SLAB // 2, SLAB // 2)
    assert np.array_equal(a, np.arange(len(a), dtype=np.uint16))


def test_the_engine_s_python_names_follow_the_c_header():
    """Unit states are named by index and stats copied by field name: both must follow csrc/pager.h."""
    for i, name in enumerate(UNIT_STATES):
        assert getattr(lib, "DLS_UNIT_" + name.upper()) == i
    assert len(UNIT_STATES) == len([k for k in dir(lib) if k.startswith("DLS_UNIT_")])
    assert list(_STATS) == [f for f, _ in ffi.typeof("dls_pager_stats").fields], \
        "a stat of dls_pager_stats is missing from region_engine._STATS (or in another order)"
