"""RemoteBuffer (rdma.buffer) over an in-memory ReplicaIO: failover, checksums and data loss, with no network.

The buffer reaches its copies only through the ReplicaIO it is given, so these tests
give it copies that fail or lie on demand.  The end-to-end tests against real donors
are in test_remote.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rdma import wire
from rdma.buffer import DataLostError, RemoteBuffer
from rdma.native import crc32c
from rdma.errors import RemoteMemoryError
from rdma.replica import LIVE, LOST, REBUILDING, Extent, Replica

PAGE = 4096
EXT_PAGES = 8


class MemoryCopies:
    """A ReplicaIO whose copies are numpy arrays.  ``failing``: copies whose calls raise."""

    def __init__(self, replicas: int = 2) -> None:
        self.replicas = replicas
        self.slabs: dict[int, np.ndarray] = {}
        self.failing: set[int] = set()
        self.failed: list[tuple[Replica, int]] = []  # (copy, wire status) as reported
        self.failovers = 0
        self.released: list[RemoteBuffer] = []
        self.reads: list[int] = []  # slab of every read call

    def copy(self, node: str, initial=LIVE) -> Replica:
        slab = len(self.slabs)
        self.slabs[slab] = np.zeros(EXT_PAGES * PAGE, np.uint8)
        return Replica(node, f"{node}:1", slab, bytes(16), EXT_PAGES * PAGE, initial)

    def _check(self, rep: Replica) -> None:
        if rep.slab in self.failing:
            raise RemoteMemoryError(wire.E_IO, f"copy {rep.slab} fails")

    def read(self, rep, offs, lens, dst, checksums):
        self._check(rep)
        self.reads.append(rep.slab)
        pos, crcs = 0, []
        for off, n in zip(offs.tolist(), lens.tolist()):
            dst[pos:pos + n] = self.slabs[rep.slab][off:off + n]
            crcs.append(crc32c(dst[pos:pos + n]))
            pos += n
        return np.array(crcs, np.uint32) if checksums else None

    def read_page(self, rep, off, n, dst, checksums):
        self._check(rep)
        self.reads.append(rep.slab)
        dst[:n] = self.slabs[rep.slab][off:off + n]
        return crc32c(dst[:n]) if checksums else 0

    def write_all(self, targets, offs, lens, src, checksums) -> list[Any]:
        results: list[Any] = []
        for rep in targets:
            try:
                self._check(rep)
            except RemoteMemoryError as exc:
                results.append(exc)
                continue
            pos, crcs = 0, []
            for off, n in zip(offs.tolist(), lens.tolist()):
                self.slabs[rep.slab][off:off + n] = src[pos:pos + n]
                crcs.append(crc32c(src[pos:pos + n]))
                pos += n
            results.append(np.array(crcs, np.uint32) if checksums else None)
        return results

    def run_parallel(self, calls) -> None:
        for call in calls:
            call()

    def copy_failed(self, buf, ext, rep, exc) -> None:
        self.failed.append((rep, getattr(exc, "code", None)))
        rep.move(LOST)  # as RemoteMemory does; it would also rebuild the extent elsewhere

    def failed_over(self) -> None:
        self.failovers += 1

    def release(self, buf) -> None:
        self.released.append(buf)


def make(n_extents: int = 2, replicas: int = 2, checksums: bool = True) -> tuple[RemoteBuffer, MemoryCopies]:
    io = MemoryCopies(replicas)
    extents = [Extent(i, i * EXT_PAGES, EXT_PAGES, [io.copy(f"n{k}") for k in range(replicas)])
               for i in range(n_extents)]
    return RemoteBuffer(io, n_extents * EXT_PAGES * PAGE, PAGE, extents, checksums), io


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_writes_reach_every_copy_and_reads_come_back():
    buf, io = make()
    data = random_bytes(len(buf))
    buf.write(0, data)
    for ext in buf.extents:
        lo = ext.first_page * PAGE
        for rep in ext.replicas:
            assert np.array_equal(io.slabs[rep.slab], data[lo:lo + EXT_PAGES * PAGE])
    assert np.array_equal(buf.read(0, len(buf)), data)
    buf.write(EXT_PAGES * PAGE - 3, b"abcdef")  # partial pages across the extent boundary
    data[EXT_PAGES * PAGE - 3:EXT_PAGES * PAGE + 3] = np.frombuffer(b"abcdef", np.uint8)
    assert np.array_equal(buf.read(0, len(buf)), data)
    assert np.array_equal(buf.read_pages([9, 2]), np.concatenate([data[9 * PAGE:10 * PAGE], data[2 * PAGE:3 * PAGE]]))
    assert io.failed == [] and io.failovers == 0 and buf.healthy()


@pytest.mark.parametrize("n", [PAGE, 3 * PAGE])  # the single-page path and the batched path
def test_a_failing_copy_is_reported_and_the_read_fails_over(n):
    buf, io = make(n_extents=1)
    data = random_bytes(len(buf))
    buf.write(0, data)
    io.failing = {rep.slab for rep in buf.extents[0].replicas}
    good = buf.extents[0].replicas[1]
    io.failing.discard(good.slab)
    for p in range(EXT_PAGES - 2):
        assert np.array_equal(buf.read(p * PAGE, n), data[p * PAGE:p * PAGE + n])
    bad = buf.extents[0].replicas[0]
    assert [(r, code) for r, code in io.failed] == [(bad, wire.E_IO)]  # reported once, then avoided
    assert bad.state is LOST and not buf.healthy()
    assert io.failovers >= 1


@pytest.mark.parametrize("n", [PAGE, 2 * PAGE])
def test_a_copy_with_wrong_bytes_is_caught_by_the_page_checksums(n):
    buf, io = make(n_extents=1)
    data = random_bytes(len(buf), seed=3)
    buf.write(0, data)
    io.reads.clear()
    buf.read(PAGE, n)
    picked = io.reads[0]  # the copy this read goes to first (reads are spread by page, deterministically)
    io.slabs[picked][PAGE:2 * PAGE] ^= 0xFF  # it now silently holds a wrong page
    assert np.array_equal(buf.read(PAGE, n), data[PAGE:PAGE + n])
    assert [(r.slab, code) for r, code in io.failed] == [(picked, wire.E_CRC)]


def test_without_checksums_wrong_bytes_go_unnoticed():
    """The control for the test above: what the checksums are for."""
    buf, io = make(n_extents=1, replicas=1, checksums=False)
    buf.write(0, random_bytes(len(buf)))
    io.slabs[0][:PAGE] = 0
    assert not buf.read(0, PAGE).any() and io.failed == []


def test_every_copy_failing_is_data_lost():
    buf, io = make(n_extents=2)
    buf.write(0, random_bytes(len(buf)))
    io.failing = {rep.slab for rep in buf.extents[1].replicas}
    assert buf.read(0, PAGE).size == PAGE  # the other extent is fine
    with pytest.raises(DataLostError, match="no live copy left"):
        buf.read(EXT_PAGES * PAGE, 2 * PAGE)
    with pytest.raises(DataLostError, match="no copy left to write"):
        buf.write(EXT_PAGES * PAGE, bytes(PAGE))


def test_a_write_survives_one_failing_copy_but_not_all():
    buf, io = make(n_extents=1)
    a, b = buf.extents[0].replicas
    io.failing = {a.slab}
    buf.write(0, b"x" * PAGE)
    assert a.state is LOST and b.state is LIVE and bytes(io.slabs[b.slab][:3]) == b"xxx"
    io.failing = {b.slab}
    with pytest.raises(DataLostError):
        buf.write(0, b"y" * PAGE)


def test_a_copy_being_rebuilt_gets_writes_but_serves_no_reads():
    buf, io = make(n_extents=1, replicas=1)
    new = io.copy("n9", initial=REBUILDING)
    buf.extents[0].replicas.append(new)
    buf.write(0, b"z" * (2 * PAGE))
    assert bytes(io.slabs[new.slab][:2 * PAGE]) == b"z" * (2 * PAGE)
    io.reads.clear()
    buf.read(0, 2 * PAGE)
    buf.read(0, PAGE)
    assert new.slab not in io.reads
    # a write that only reached the copy being rebuilt is not durable
    io.failing = {buf.extents[0].replicas[0].slab}
    with pytest.raises(DataLostError, match="every copy failed the write"):
        buf.write(0, bytes(PAGE))


def test_free_releases_once_and_then_refuses_io():
    buf, io = make()
    buf.free()
    buf.free()
    assert io.released == [buf]
    with pytest.raises(ValueError, match="freed"):
        buf.read(0, 1)
