"""RemoteMemory end to end: a real broker, donor node processes, the C data plane, faults."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from nodesvc.bus import messages
from nodesvc.bus.procs import wait_until
from nodesvc.bus.rpc import CommandError
from rdma import wire
from rdma.errors import RemoteMemoryError
from rdma.remote import RemoteMemory
from rdma.replica import LIVE
from tests.rdma.donors import ROOT, SLAB

PAGE = 4096


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)


def test_replicated_buffer_roundtrip(broker, donor_factory, consumer_factory, control_factory):
    donor_factory(broker.url, 3)
    mem = consumer_factory(broker.url, 3, replicas=2, seed=1)
    buf = mem.alloc(5 * SLAB + 123)
    assert len(buf.extents) == 6
    for ext in buf.extents:
        nodes = [r.node for r in ext.replicas]
        assert len(set(nodes)) == 2, dump(buf.placement())
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, data)
    assert np.array_equal(buf.read(0, len(buf)), data)
    # unaligned read/modify/write across an extent boundary
    buf.write(SLAB - 10, b"0123456789abcdefghij")
    data[SLAB - 10:SLAB + 10] = np.frombuffer(b"0123456789abcdefghij", np.uint8)
    assert bytes(buf.read(SLAB - 12, 24)) == data[SLAB - 12:SLAB + 12].tobytes()
    # scattered pages, out of order, across extents
    pages = np.array([700, 3, 1279, 256, 257, 4])
    src = rng.integers(0, 256, len(pages) * PAGE, dtype=np.uint8)
    buf.write_pages(pages, src)
    for i, p in enumerate(pages):
        data[p * PAGE:(p + 1) * PAGE] = src[i * PAGE:(i + 1) * PAGE]
    assert np.array_equal(buf.read_pages(pages), src)
    out = np.empty(len(buf), np.uint8)
    buf.read(0, len(buf), out=out)
    assert np.array_equal(out, data)
    with pytest.raises(IndexError):
        buf.read(len(buf) - 1, 2)
    with pytest.raises(IndexError):
        buf.read_pages([buf.npages])
    # each replica really holds the data: read every copy directly
    ext = buf.extents[1]
    for rep in ext.replicas:
        got = np.empty(SLAB, np.uint8)
        mem.dataplane.endpoint(rep).read(rep.slab, rep.token, [0], [SLAB], got)
        assert np.array_equal(got, data[SLAB:2 * SLAB])
    # a copy that silently holds wrong bytes is caught by the page checksums:
    # the read fails over to the good copy and the bad one is replaced
    bad = ext.readable()[0]
    mem.dataplane.endpoint(bad).write(bad.slab, bad.token, [0], [PAGE], np.zeros(PAGE, np.uint8))
    assert np.array_equal(buf.read(SLAB, PAGE), data[SLAB:SLAB + PAGE])
    assert bad not in ext.replicas or bad.state is not LIVE
    assert mem.wait_healthy(buf, 20)
    # the same through a batched read, on the copy that batch reads from
    ext2 = buf.extents[2]
    live2 = [r for r in ext2.replicas if r.state is LIVE]
    bad2 = live2[(ext2.index + ext2.first_page) % len(live2)]
    mem.dataplane.endpoint(bad2).write(bad2.slab, bad2.token, [5 * PAGE], [PAGE], np.zeros(PAGE, np.uint8))
    assert np.array_equal(buf.read(2 * SLAB, SLAB), data[2 * SLAB:3 * SLAB])
    assert bad2.state is not LIVE
    assert mem.wait_healthy(buf, 20)
    assert np.array_equal(buf.read(0, len(buf)), data)
    buf.free()
    mem.close()
    # every slab went back
    ctl = control_factory(broker.url)
    for n in ("donor0", "donor1", "donor2"):
        st = ctl.call(n, "donor_status", {})
        assert st["slabs"] == [], st


class Load:
    """Writers and readers hammering a buffer while faults happen; the model knows every byte."""

    def __init__(self, buf, seed: int = 0) -> None:
        self.buf = buf
        self.model = np.zeros(len(buf), np.uint8)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.ops = 0
        self.lock = threading.Lock()
        self.seed = seed
        rng = np.random.default_rng(seed)
        init = rng.integers(0, 256, len(buf), dtype=np.uint8)
        buf.write(0, init)
        self.model[:] = init
        self.threads = [threading.Thread(target=self._writer), threading.Thread(target=self._reader)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _writer(self) -> None:
        rng = np.random.default_rng(self.seed + 1)
        npages = self.buf.npages
        try:
            while not self.stop.is_set():
                pages = np.unique(rng.integers(0, npages, 16))
                data = rng.integers(0, 256, len(pages) * PAGE, dtype=np.uint8)
                with self.lock:  # the model and the buffer change together
                    self.buf.write_pages(pages, data)
                    for i, p in enumerate(pages):
                        self.model[p * PAGE:(p + 1) * PAGE] = data[i * PAGE:(i + 1) * PAGE]
                self.ops += 1
        except Exception as exc:  # reported by the test
            self.errors.append(f"writer: {exc!r}")

    def _reader(self) -> None:
        rng = np.random.default_rng(self.seed + 2)
        try:
            while not self.stop.is_set():
                p = int(rng.integers(0, self.buf.npages - 8))
                with self.lock:
                    got = self.buf.read(p * PAGE, 8 * PAGE)
                    # compared under the lock: the model slice is a view, and a write between the
                    # lock's release and the compare would change it under a correct read
                    same = np.array_equal(got, self.model[p * PAGE:(p + 8) * PAGE])
                if not same:
                    self.errors.append(f"reader: pages {p}..{p + 8} differ")
                    return
                self.ops += 1
        except Exception as exc:
            self.errors.append(f"reader: {exc!r}")


def _nodes_of(buf) -> set[str]:
    return {r.node for e in buf.extents for r in e.replicas}


def test_kill9_donor_under_load_loses_nothing_and_rebuilds(mosquitto, donor_factory, consumer_factory):
    procs = {p.node: p for p in donor_factory(mosquitto.url, 4)}
    mem = consumer_factory(mosquitto.url, 4, replicas=2, seed=3, io_timeout_s=3)
    buf = mem.alloc(8 * SLAB)
    victim = buf.extents[0].replicas[0].node
    held = sum(1 for e in buf.extents for r in e.replicas if r.node == victim)
    assert held > 0
    with Load(buf, seed=7) as load:
        wait_until(lambda: load.ops > 20, 20, "load to run")
        procs[victim].kill9()
        ops_at_kill = load.ops
        wait_until(lambda: load.ops > ops_at_kill + 50 or load.errors, 30, "load to go on after the kill")
        assert mem.wait_healthy(buf, 30), dump(buf.placement())
    assert not load.errors, load.errors
    assert victim not in _nodes_of(buf)
    assert all(r.state is LIVE for e in buf.extents for r in e.replicas)
    assert all(len({r.node for r in e.replicas}) == 2 for e in buf.extents)
    assert mem.stats["replicas_rebuilt"] >= held and mem.stats["replicas_lost"] >= held
    # every byte, from every copy
    assert np.array_equal(buf.read(0, len(buf)), load.model)
    for e in buf.extents:
        lo, hi = e.first_page * PAGE, (e.first_page + e.npages) * PAGE
        for rep in e.replicas:
            got = np.empty(hi - lo, np.uint8)
            mem.dataplane.endpoint(rep).read(rep.slab, rep.token, [0], [hi - lo], got)
            assert np.array_equal(got, load.model[lo:hi]), f"copy on {rep.node} differs"


def test_a_copy_that_failed_on_io_suspects_its_donor_before_the_rebuild_is_placed(mosquitto, donor_factory,
                                                                                     consumer_factory):
    """An I/O error or a timeout (the negative errnos the data plane and the region engine report) may
    mean the donor is gone: it is pinged, and one that does not answer is counted dead before the
    repair is queued, so the new copy is never placed on it (a map there would wait out its 10 s
    timeout).  The donor here is stopped (SIGSTOP): still online on the bus, silent on its data
    plane.  A status a live donor answered (a bad token) only gives that slab back."""
    procs = {p.node: p for p in donor_factory(mosquitto.url, 4)}
    mem = consumer_factory(mosquitto.url, 4, replicas=2, seed=9, io_timeout_s=3)
    buf = mem.alloc(4 * SLAB)
    data = np.random.default_rng(2).integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, data)
    ext, silent = buf.extents[0], buf.extents[0].replicas[0]
    # a copy of another extent, on another donor, whose extent keeps a copy off the silent donor
    other, alive = next((e, r) for e in buf.extents[1:] for r in e.replicas
                        if silent.node not in {x.node for x in e.replicas})
    buf.io.copy_failed(buf, other, alive, RemoteMemoryError(wire.E_TOKEN, "a bad token, as a live donor answers"))
    assert alive.node not in mem._dead_nodes
    procs[silent.node].freeze()
    try:
        buf.io.copy_failed(buf, ext, silent, RemoteMemoryError(wire.E_IO, "a connection reset, as a kill gives"))
        assert silent.node in mem._dead_nodes  # counted dead before copy_failed returned
        assert mem.wait_healthy(buf, 60), dump(buf.placement())
        assert silent.node not in _nodes_of(buf)
        assert np.array_equal(buf.read(0, len(buf)), data)
    finally:
        procs[silent.node].thaw()


def test_a_capped_rebuild_keeps_to_its_rate_and_loses_nothing(mosquitto, donor_factory, consumer_factory):
    """``rebuild_bytes_per_s``: the copies a killed donor held are rebuilt no faster than the cap (here
    1 MiB/s, so ``held`` 1 MiB extents take at least ``held`` seconds from the loss to a healthy
    buffer), and every copy ends right."""
    procs = {p.node: p for p in donor_factory(mosquitto.url, 4)}
    mem = consumer_factory(mosquitto.url, 4, replicas=2, seed=5, io_timeout_s=3, rebuild_bytes_per_s=1 << 20)
    buf = mem.alloc(6 * SLAB)
    data = np.random.default_rng(1).integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, data)
    victim = buf.extents[0].replicas[0].node
    held = sum(1 for e in buf.extents for r in e.replicas if r.node == victim)
    procs[victim].kill9()
    assert np.array_equal(buf.read(0, len(buf)), data)  # served by the other copies; finds the loss
    wait_until(lambda: mem.stats["replicas_lost"] >= 1, 30, "the loss to be seen")
    lost_at = time.monotonic()
    assert mem.wait_healthy(buf, 60), dump(buf.placement())
    took = time.monotonic() - lost_at
    assert took >= 0.95 * held * SLAB / (1 << 20), f"{held} MiB rebuilt in {took:.2f} s at a 1 MiB/s cap"
    assert mem.stats["replicas_rebuilt"] >= held and victim not in _nodes_of(buf)
    for e in buf.extents:
        lo, hi = e.first_page * PAGE, (e.first_page + e.npages) * PAGE
        for rep in e.replicas:
            got = np.empty(hi - lo, np.uint8)
            mem.dataplane.endpoint(rep).read(rep.slab, rep.token, [0], [hi - lo], got)
            assert np.array_equal(got, data[lo:hi]), f"copy on {rep.node} differs"



def test_a_repair_that_cannot_finish_is_retried_once_per_extent_and_less_often(mosquitto, donor_factory,
                                                                              consumer_factory):
    """A repair that fails (here every attempt) is tried again after ``repair_retry_s[0]``, then twice
    as long each time up to ``repair_retry_s[1]``; failures reported meanwhile for the same extent are
    folded into one pending attempt, so there is only ever one chain of retries (two chains would put
    some attempts closer together than the back-off allows)."""
    donor_factory(mosquitto.url, 2)
    mem = consumer_factory(mosquitto.url, 2, replicas=2, seed=1)
    buf = mem.alloc(SLAB)
    ext = buf.extents[0]
    mem.repair_retry_s = (0.1, 0.4)
    calls: list[float] = []
    release = threading.Event()

    def failing_repair(b, e) -> bool:
        calls.append(time.monotonic())
        if len(calls) == 1:
            release.wait(30)  # the repairer is busy: what comes meanwhile queues
        return False

    mem._repair = failing_repair
    mem._queue_repair(buf, ext)
    wait_until(lambda: calls, 10, "the first attempt")
    for _ in range(5):  # five more failures of the same extent while the first attempt runs: one queued
        mem._queue_repair(buf, ext)
    release.set()
    wait_until(lambda: len(calls) >= 6, 30, "six attempts")
    gaps = [b - a for a, b in zip(calls[2:], calls[3:])]  # from the third: the timer's chain alone
    for got, least in zip(gaps, (0.2, 0.4, 0.4)):
        assert got >= 0.9 * least, f"attempts {[round(c - calls[0], 3) for c in calls]}"
    mem._repair = lambda b, e: calls.append(time.monotonic()) or True  # the next attempt ends the chain
    n = len(calls)
    wait_until(lambda: not mem._repair_waiting and not mem._repair_tries, 10, "the retries to stop")
    assert len(calls) == n + 1  # and nothing is left to try again

def test_a_rebuild_cap_must_be_a_rate():
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rebuild_bytes_per_s"):
            RemoteMemory("mqtt://127.0.0.1:1", rebuild_bytes_per_s=bad)


def test_reclaim_under_load_returns_memory_and_loses_nothing(mosquitto, donor_factory, consumer_factory,
                                                             control_factory):
    procs = {p.node: p for p in donor_factory(mosquitto.url, 3, deadline_s=5.0)}
    mem = consumer_factory(mosquitto.url, 3, replicas=2, seed=5)
    ctl = control_factory(mosquitto.url)
    buf = mem.alloc(24 * SLAB)
    victim = max(procs, key=lambda n: sum(r.node == n for e in buf.extents for r in e.replicas))
    held = sum(r.node == victim for e in buf.extents for r in e.replicas)
    with Load(buf, seed=11) as load:
        wait_until(lambda: load.ops > 20, 20, "load to run")
        rss_before = procs[victim].rss()
        assert rss_before > held * SLAB  # the lent pages are resident
        t0 = time.monotonic()
        res = ctl.call(victim, "reclaim", {"bytes": held * SLAB, "pause_s": 60.0})
        assert len(res["evicting"]) == held
        st = wait_until(lambda: (s := ctl.call(victim, "donor_status", {}))["slabs"] == [] and s, 20,
                        "the evicted slabs to come back")
        reclaim_s = time.monotonic() - t0
        assert st["stats"]["forced_unmaps"] == 0  # the consumer acked every one in time
        rss_after = procs[victim].rss()
        assert mem.wait_healthy(buf, 30), dump(buf.placement())
        ops = load.ops
        wait_until(lambda: load.ops > ops + 20 or load.errors, 20, "load to go on")
    assert not load.errors, load.errors
    assert rss_before - rss_after > 0.8 * held * SLAB, (rss_before, rss_after, held)
    assert reclaim_s < 5.0
    assert victim not in _nodes_of(buf)
    assert np.array_equal(buf.read(0, len(buf)), load.model)
    assert mem.stats["evictions"] == held


def test_sole_copy_is_moved_before_the_donor_unmaps(mosquitto, donor_factory, consumer_factory, control_factory):
    donor_factory(mosquitto.url, 2, deadline_s=10.0)
    mem = consumer_factory(mosquitto.url, 2, replicas=1, seed=2)
    ctl = control_factory(mosquitto.url)
    buf = mem.alloc(4 * SLAB)
    data = np.random.default_rng(4).integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, data)
    victim = buf.extents[0].replicas[0].node
    held = sum(r.node == victim for e in buf.extents for r in e.replicas)
    ctl.call(victim, "reclaim", {"bytes": held * SLAB, "pause_s": 60.0})
    wait_until(lambda: ctl.call(victim, "donor_status", {})["slabs"] == [], 20, "the slabs to be moved and returned")
    st = ctl.call(victim, "donor_status", {})
    assert st["stats"]["forced_unmaps"] == 0
    assert victim not in _nodes_of(buf)
    assert np.array_equal(buf.read(0, len(buf)), data)
    assert mem.stats["bytes_copied"] >= held * SLAB


def test_donor_survives_bad_commands(mosquitto, donor_factory, control_factory):
    (proc,) = donor_factory(mosquitto.url, 1)
    ctl = control_factory(mosquitto.url)
    wait_until(lambda: "donor0" in ctl.donors(), 20, "the donor")
    for op, args, msg in [("map", {}, "missing"), ("map", {"consumer": 3}, "must be str"),
                          ("unmap", {"slab": 999, "token": "00"}, "not lent"),
                          ("unmap", {"slab": 99999, "token": "00"}, "between 0 and 65535"),  # no such slab id
                          ("unmap", {"slab": "x", "token": "00"}, "must be int"),
                          ("reclaim", {"bytes": "lots"}, "must be int"),
                          ("no_such_op", {}, "no_such_op")]:
        with pytest.raises(CommandError, match=msg):
            ctl.call("donor0", op, args, timeout=5)
    async def junk():  # raw garbage on the command topic
        for payload in (b"\xff\xfe", b"[]", b'{"schema":1}', b"{" * 5000, messages.encode({"id": "x", "op": 5})):
            await ctl.bus.publish(messages.node_topic("donor0", "cmd"), payload, qos=1)

    asyncio.run_coroutine_threadsafe(junk(), ctl._loop).result(10)
    res = ctl.call("donor0", "map", {"consumer": "ok-consumer"}, timeout=5)
    assert res["slab_bytes"] == SLAB
    assert proc.proc.poll() is None


def test_a_call_to_a_node_counted_dead_meanwhile_stops_waiting(mosquitto, donor_factory, control_factory):
    """``give_up``: a map the repair sends to a donor that is counted dead while it waits (its Last
    Will, another copy's failure) stops waiting then, instead of at its timeout.  The donor here is
    stopped, so without ``give_up`` the call would wait its whole 60 s."""
    (proc,) = donor_factory(mosquitto.url, 1)
    ctl = control_factory(mosquitto.url)
    wait_until(lambda: "donor0" in ctl.donors(), 20, "the donor")
    assert ctl.call("donor0", "ping", {}, timeout=10, give_up=lambda: False) is not None  # answers when alive
    dead, outcome = threading.Event(), []

    def call() -> None:
        try:
            outcome.append(ctl.call("donor0", "ping", {}, timeout=60, give_up=dead.is_set))
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    proc.freeze()
    t = threading.Thread(target=call)
    try:
        t.start()
        dead.set()
        t.join(30)
        assert not t.is_alive(), "the call kept waiting for a node counted dead"
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionError), outcome
    finally:
        proc.thaw()
        t.join(90)


def test_standalone_donor_shell_serves_consumers(amqtt_broker, donor_factory, consumer_factory):
    donor_factory(amqtt_broker.url, 2, shell="donor")
    mem = consumer_factory(amqtt_broker.url, 2, replicas=2, lease_s=1.0)
    buf = mem.alloc(SLAB)
    buf.write(0, b"x" * 5000)
    assert bytes(buf.read(4990, 10)) == b"x" * 10
    before = buf.placement()
    # an "offline" state for a donor whose slab server still answers (a broker
    # hiccup) must not throw its copies away
    asyncio.run_coroutine_threadsafe(mem.control.bus.publish(
        messages.node_topic("donor0", "state"), messages.encode({"status": "offline", "node": "donor0"}),
        qos=1, retain=False), mem.control._loop).result(5)
    wait_until(lambda: mem.stats["offline_kept"] == 1, 10, "the consumer to find donor0's slab server alive")
    assert not mem.control.donors()["donor0"].online
    assert buf.placement() == before and buf.healthy()
    assert mem.stats["replicas_lost"] == 0
    assert bytes(buf.read(0, 3)) == b"xxx"
    # renewals keep the 1 s leases alive well past a second: seven more rounds (both
    # donors each) come at least six thirds of a lease, 2 s, after the last one before
    renewed = mem.stats["leases_renewed"]
    wait_until(lambda: mem.stats["leases_renewed"] >= renewed + 2 * 7, 10, "seven rounds of lease renewals")
    for n in ("donor0", "donor1"):
        assert len(mem.control.call(n, "donor_status", {})["slabs"]) == 1
    assert bytes(buf.read(0, 3)) == b"xxx"


def test_slabs_of_a_killed_consumer_come_back(mosquitto, donor_factory, control_factory):
    donor_factory(mosquitto.url, 1)
    ctl = control_factory(mosquitto.url)
    code = (
        "import sys, time\n"
        "from rdma import RemoteMemory\n"
        f"m = RemoteMemory(broker={mosquitto.url!r}, replicas=1, consumer_id='doomed', lease_s=1.0)\n"
        "b = m.alloc(3 * (1 << 20)); b.write(0, b'x' * 100)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert len(ctl.call("donor0", "donor_status", {})["slabs"]) == 3
        proc.kill()
        proc.wait(10)
        wait_until(lambda: ctl.call("donor0", "donor_status", {})["slabs"] == [], 10,
                   "the dead consumer's slabs to be taken back")
    finally:
        proc.kill()
        proc.wait(10)
