"""RemoteRegion against real donors: node daemon processes on a real broker, the C engine faulting.

Fork, loss, kill -9, reclaim and close under load; the engine alone (slab servers in this process)
is test_pager.py."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from nodesvc.bus.procs import wait_until
from rdma.errors import RemoteMemoryError
from tests.rdma.donors import ROOT, SLAB

UNIT = 64 << 10


class Writers:
    """Threads adding 1 to runs of their own elements (slices big enough that numpy drops the
    GIL), until stopped; ``expected()`` replays what they did."""

    def __init__(self, a: np.ndarray, threads: int = 3, span: int = 1024) -> None:
        self.a, self.n, self.span = a, threads, span
        self.done: list[list[int]] = [[] for _ in range(threads)]
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]

    def _run(self, k: int) -> None:
        rng = np.random.default_rng(100 + k)
        a, n, span = self.a, self.n, self.span
        try:
            while not self._stop.is_set():
                i = int(rng.integers(0, len(a) // n - span)) * n + k
                a[i:i + span * n:n] += 1
                self.done[k].append(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    @property
    def ops(self) -> int:
        return sum(len(d) for d in self.done)

    def expected(self) -> np.ndarray:
        want = np.zeros(len(self.a), self.a.dtype)
        for k, starts in enumerate(self.done):
            for i in starts:
                want[i:i + self.span * self.n:self.n] += 1
        return want

    def __enter__(self) -> "Writers":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def nodes_of(region) -> set[str]:
    return {r.node for e in region.buffer.extents for r in e.replicas}


def test_numpy_and_torch_views_over_donors_and_the_borrowed_memory_shows(mosquitto, donor_factory,
                                                                          consumer_factory, control_factory):
    donor_factory(mosquitto.url, 3)
    mem = consumer_factory(mosquitto.url, 3, replicas=2, seed=1, consumer_id="n-borrower")
    region = mem.map(8 * SLAB, local_bytes=SLAB)
    table = region.array(np.float32, (SLAB // 16, 16))  # 4 MiB: no copy, pages on donors
    rng = np.random.default_rng(0)
    data = rng.standard_normal(table.shape).astype(np.float32)
    table[:] = data
    import torch

    t = region.tensor(torch.float64, (SLAB // 8, 4))  # the next free 4 MiB
    t.copy_(torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape))
    assert np.array_equal(table, data)
    assert torch.equal(t.sum(dim=1), (torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape)).sum(dim=1))
    assert t.data_ptr() == region.address + 4 * SLAB and table.ctypes.data == region.address
    st = region.stats()
    assert st["resident_units"] * region.unit <= SLAB and st["evicted_dirty"] > 0
    with pytest.raises(MemoryError, match="do not fit"):
        region.array(np.uint8, 1)
    # the donors count what this consumer borrows: every copy of every slab
    ctl = control_factory(mosquitto.url)

    def lent() -> int:
        return sum(s["bytes"] for n in mem.donors() for s in ctl.call(n, "donor_status", {})["slabs"]
                   if s["consumer"] == "n-borrower")

    assert lent() == 2 * 8 * SLAB
    region.close()
    wait_until(lambda: lent() == 0, 10, "the slabs to go back")


def test_a_forked_child_fails_loudly_and_the_parent_goes_on(mosquitto, donor_factory, consumer_factory):
    donor_factory(mosquitto.url, 2)
    mem = consumer_factory(mosquitto.url, 2, replicas=2, seed=2)
    region = mem.map(4 * SLAB, local_bytes=SLAB)
    a = region.array(np.int32)
    a[:] = np.arange(len(a), dtype=np.int32)  # most of it is on the donors only now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()
        os.close(r)
        try:
            region.read(0, 16)
            os.write(w, b"read-worked ")
        except RuntimeError:
            os.write(w, b"read-raised ")
        os.write(w, b"touching ")
        os.write(w, str(int(a[0])).encode())  # never fetched here: SIGSEGV, not zeros
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    said = os.read(r, 1024).decode().split()
    os.close(r)
    assert said == ["read-raised", "touching"], said
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert np.array_equal(a, np.arange(len(a), dtype=np.int32))
    a[::1000] = -1
    region.flush()
    assert int((a == -1).sum()) == len(a[::1000])


def test_every_copy_lost_raises_for_python_and_is_sigbus_for_a_touch(mosquitto, donor_factory):
    """Every copy the engine holds of unit 0 goes at once.  The donors are all stopped (SIGSTOP)
    before any is killed: killed one after the other, RemoteMemory saw the first die and rebuilt
    the extent on the third donor from the second before the second died (a correct failover that
    made the read succeed about one run in three)."""
    procs = {p.node: p for p in donor_factory(mosquitto.url, 3)}
    child = subprocess.Popen([sys.executable, "-m", "tests.rdma.region_child", "lost", mosquitto.url], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("ready"):
                break
        assert lines and lines[-1].startswith("ready"), (lines, child.stderr.read())
        copies = json.loads(next(x for x in lines if x.startswith("copies ")).split(" ", 1)[1])
        victims = json.loads(lines[-1].split(" ", 1)[1])
        # the engine's map is RemoteMemory's placement: no copy the test does not know about
        assert len(copies["engine"]) == 2 and victims == copies["placed"], copies
        assert all(c["role"] == "live" and not c["failed"] for c in copies["engine"]), copies
        for node in victims:  # nobody serves, so nothing can be rebuilt from a survivor...
            procs[node].freeze()
        for node in victims:  # ...then they die
            procs[node].kill9()
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines += out.splitlines()
    # lost already when the donors' Last Wills arrived first: RemoteMemory salvaged the extent (its
    # resident units onto the third donor), and a unit that was only on the dead donors is poisoned then
    assert "state absent" in lines and ("state before read absent" in lines or "state before read lost" in lines), lines
    assert any(x.startswith("read raised DataLostError") for x in lines), (lines, err)
    assert lines[-1] == "touching" and child.returncode == -signal.SIGBUS, (child.returncode, lines, err)


def test_an_extent_whose_every_donor_dies_keeps_what_was_resident(mosquitto, donor_factory, consumer_factory):
    """Both donors of extent 0 are stopped, then killed.  RemoteMemory salvages the extent: the units
    that were resident (one of them written since) go to a new copy on a surviving donor and are
    rebuilt to two copies; the units that were only on the dead donors are lost, never zeros."""
    procs = {p.node: p for p in donor_factory(mosquitto.url, 4)}
    mem = consumer_factory(mosquitto.url, 4, replicas=2, seed=4, io_timeout_s=3)
    region = mem.map(4 * SLAB, local_bytes=16 * UNIT, unit=UNIT)
    a = region.array(np.uint32)
    per = UNIT // 4
    want = np.arange(len(a), dtype=np.uint32) + 0x5A5A0000  # never zeros
    a[:] = want
    region.flush()
    region.prefetch(2 * SLAB, 2 * SLAB)  # the second half in: the first is written back and evicted
    for u in (0, 9):  # back in memory, clean (with what the engine fetched beside them)
        assert np.array_equal(a[u * per:(u + 1) * per], want[u * per:(u + 1) * per])
    units = SLAB // UNIT  # of extent 0

    def states() -> list[str]:
        return [region.unit_state(u) for u in range(4 * SLAB // UNIT)]

    def settled() -> bool:  # every evictor asleep before and after two looks alike, nothing on its way:
        idle = region.stats()["evictors_idle"]  # with no fault until the salvage, nothing wakes them
        s = states()
        return bool(idle) and s == states() and not {"evicting", "writeback", "fetching"} & set(s) \
            and bool(region.stats()["evictors_idle"])

    wait_until(settled, 10, "the evictor to settle")
    kept = [u for u in range(units) if region.unit_state(u) == "clean"]
    gone = [u for u in range(units) if region.unit_state(u) == "absent"]
    assert {0, 9} <= set(kept) and gone and len(kept) + len(gone) == units, (kept, gone)
    victims = sorted({r.node for r in region.buffer.extents[0].replicas})
    for node in victims:  # nobody serves, so nothing is rebuilt from a survivor...
        procs[node].freeze()
    for node in victims:  # ...then they die
        procs[node].kill9()
    a[0] += 7  # written after the loss: only this process has it
    want[0] += 7
    with pytest.raises(RemoteMemoryError):  # nothing durable takes it: this is how the loss is seen
        region.flush()
    wait_until(lambda: mem.stats["extents_salvaged"] >= 1, 60, "extent 0 salvaged")
    assert mem.wait_healthy(region.buffer, 60), region.placement()
    region.flush()
    assert [region.unit_state(u) for u in gone] == ["lost"] * len(gone)  # only the dead donors had them
    assert region.stats()["units_lost"] >= len(gone)
    assert not set(victims) & nodes_of(region)

    def kept_evicted() -> bool:  # the second half through memory again, until the kept units have left
        region.prefetch(2 * SLAB, 2 * SLAB)  # (CLOCK gives a unit written or refetched another turn)
        return all(region.unit_state(u) == "absent" for u in kept)

    try:
        wait_until(kept_evicted, 60, "the kept units evicted")  # they come back from the new copies
    except TimeoutError as exc:  # which unit stayed, in which state, and what the engine saw
        raise AssertionError(f"{exc}: {[(u, region.unit_state(u)) for u in kept]}, {region.stats()}, "
                             f"{region.placement()}") from exc
    for u in kept:
        assert np.array_equal(a[u * per:(u + 1) * per], want[u * per:(u + 1) * per]), f"unit {u}"
    for rep in region.buffer.extents[0].replicas:  # and both copies hold them
        for u in kept:
            got = np.empty(UNIT, np.uint8)
            mem.dataplane.endpoint(rep).read(rep.slab, rep.token, [u * UNIT], [UNIT], got)
            assert np.array_equal(got.view(np.uint32), want[u * per:(u + 1) * per]), f"unit {u} on {rep.node}"


def test_a_donor_killed_mid_run_loses_nothing(mosquitto, donor_factory, consumer_factory):
    procs = {p.node: p for p in donor_factory(mosquitto.url, 3)}
    mem = consumer_factory(mosquitto.url, 3, replicas=2, seed=3, io_timeout_s=3)
    region = mem.map(8 * SLAB, local_bytes=SLAB)
    a = region.array(np.int64)
    victim = region.buffer.extents[0].replicas[0].node
    with Writers(a) as load:
        wait_until(lambda: load.ops > 200 or load.errors, 30, "the writers to run")
        procs[victim].kill9()
        at_kill = load.ops
        wait_until(lambda: load.ops > at_kill + 300 or load.errors, 60, "the writers to go on after the kill")
        assert mem.wait_healthy(region.buffer, 30), region.placement()
    assert not load.errors, load.errors
    assert np.array_equal(a, load.expected())
    region.flush()
    st = region.stats()
    assert st["units_lost"] == 0 and st["writeback_failures"] == 0
    assert victim not in nodes_of(region)
    assert mem.stats["replicas_rebuilt"] > 0
    # every copy holds what the program wrote
    want = load.expected().view(np.uint8)
    for e in region.buffer.extents:
        lo = e.first_page * 4096
        for rep in e.replicas:
            got = np.empty(e.npages * 4096, np.uint8)
            mem.dataplane.endpoint(rep).read(rep.slab, rep.token, [0], [len(got)], got)
            assert np.array_equal(got, want[lo:lo + len(got)]), f"copy of extent {e.index} on {rep.node}"


def test_a_donor_reclaim_mid_run_moves_the_data_and_the_run_goes_on(mosquitto, donor_factory, consumer_factory,
                                                                     control_factory):
    procs = {p.node: p for p in donor_factory(mosquitto.url, 3, deadline_s=5.0)}
    mem = consumer_factory(mosquitto.url, 3, replicas=2, seed=5)
    ctl = control_factory(mosquitto.url)
    region = mem.map(12 * SLAB, local_bytes=2 * SLAB)
    a = region.array(np.int64)
    victim = max(procs, key=lambda n: sum(r.node == n for e in region.buffer.extents for r in e.replicas))
    held = sum(r.node == victim for e in region.buffer.extents for r in e.replicas)
    with Writers(a) as load:
        wait_until(lambda: load.ops > 200 or load.errors, 30, "the writers to run")
        res = ctl.call(victim, "reclaim", {"bytes": held * SLAB, "pause_s": 60.0})
        assert len(res["evicting"]) == held
        wait_until(lambda: ctl.call(victim, "donor_status", {})["slabs"] == [], 30, "the slabs to come back")
        assert ctl.call(victim, "donor_status", {})["stats"]["forced_unmaps"] == 0  # every one moved in time
        ops = load.ops
        wait_until(lambda: load.ops > ops + 200 or load.errors, 30, "the writers to go on")
        assert mem.wait_healthy(region.buffer, 30)
    assert not load.errors, load.errors
    assert victim not in nodes_of(region)
    assert np.array_equal(a, load.expected())
    assert region.stats()["units_lost"] == 0 and mem.stats["evictions"] == held


def test_closing_under_touching_threads_with_donors_is_sigsegv_never_wrong_bytes(mosquitto, donor_factory):
    donor_factory(mosquitto.url, 2)
    out = subprocess.run([sys.executable, "-m", "tests.rdma.region_child", "close", mosquitto.url], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "closing after" in out.stdout and "WRONG" not in out.stdout, out.stdout + out.stderr
    assert "survived" not in out.stdout
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)
