"""The region engine (csrc/pager*.c) when a system call on its mapping fails: the failure is an event
Python sees (``DLS_EV_ENGINE_ERROR``: which call, errno, which units), never a silent continue, and
the units it concerns stay correct."""

from __future__ import annotations

import ctypes
import errno
import os
import platform

import numpy as np

from nodesvc.bus.procs import wait_until
from tests.rdma.regions import SLAB

UNIT = 64 << 10
MLOCK_ONFAULT = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
# The system calls themselves: AddressSanitizer (make sanitize) turns the libc mlock/munlock into no-ops.
_SYS = {"x86_64": (325, 150), "aarch64": (284, 229)}[platform.machine()]  # mlock2, munlock


def mlock2(addr: int, size: int, flags: int) -> int:
    return _libc.syscall(_SYS[0], addr, size, flags)


def munlock(addr: int, size: int) -> int:
    return _libc.syscall(_SYS[1], addr, size, 0)


def _drop_errors(region):
    return [e for e in region.engine_errors() if e[0].startswith("MADV_DONTNEED")]


def test_pages_the_kernel_will_not_drop_stay_resident_are_reported_and_evicted_once_it_will(local_cluster):
    """Locked pages (mlock2 with MLOCK_ONFAULT: each page is locked as the engine installs it) make the
    evictor's MADV_DONTNEED fail with EINVAL.  The units stay resident with the right bytes, each failure
    is an event with its errno and units, and once the pages are unlocked eviction brings the region
    back under its budget."""
    region, io = local_cluster.region(SLAB, local_bytes=4 * UNIT, unit=UNIT)  # 16 units, 4 resident
    base, size = region.address, region.nbytes
    assert mlock2(base, size, MLOCK_ONFAULT) == 0, os.strerror(ctypes.get_errno())
    locked = True
    try:
        a = region.array(np.uint8)
        data = np.random.default_rng(7).integers(0, 256, 6 * UNIT, dtype=np.uint8)
        a[:len(data)] = data  # six units in a budget of four: the evictor must drop some, and cannot
        assert wait_until(lambda: _drop_errors(region), timeout=60)
        what, err, unit, count = _drop_errors(region)[0]
        assert err == errno.EINVAL and 0 <= unit < 6 and count >= 1
        st = region.stats()
        assert st["engine_errors"] >= 1 and st["resident_units"] > 4  # over budget, not dropped silently
        assert np.array_equal(a[:len(data)], data)  # every unit still holds its bytes
        assert munlock(base, size) == 0
        locked = False
        # the evictor tries again: now the pages go, written back, and read back right
        assert wait_until(lambda: region.stats()["resident_units"] <= 4, timeout=60)
        assert np.array_equal(a[:len(data)], data)
        assert not io.failed
    finally:
        if locked:
            munlock(base, size)
