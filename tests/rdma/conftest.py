"""Fixtures for remote-memory tests: donor processes, consumers and an operator's control plane.

The brokers they run on (``broker``, ``mosquitto``, ``amqtt_broker``) come from tests/conftest.py.
Each factory stops or closes what it started at the end of the test, consumers before donors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from nodesvc.bus.procs import stop_proc, wait_until
from rdma import RemoteMemory
from rdma.control import ControlPlane
from tests.rdma.donors import DonorProc


@pytest.fixture
def donor_factory(tmp_path) -> Callable[..., list[DonorProc]]:
    """``start(broker_url, n, prefix="donor", **DonorProc options)``: n donor processes named
    prefix0, prefix1, ... (numbered on across calls)."""
    procs: list[DonorProc] = []

    def start(broker_url: str, n: int, prefix: str = "donor", **kw) -> list[DonorProc]:
        new = [DonorProc(f"{prefix}{len(procs) + i}", broker_url, tmp_path, **kw) for i in range(n)]
        procs.extend(new)
        return new

    yield start
    # Signal all first, then wait.  The daemon's clean stop waits up to ~5 s on its
    # final "offline" publish; the tests only need the processes gone.
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        stop_proc(p.proc, timeout=max(0.1, deadline - time.monotonic()))
        p.log.close()


@pytest.fixture
def consumer_factory(donor_factory) -> Callable[..., RemoteMemory]:
    """``open(broker_url, donors, **RemoteMemory options)``: a RemoteMemory that already sees
    ``donors`` donors.  Closed at the end of the test, before the donors stop."""
    mems: list[RemoteMemory] = []

    def open_(broker_url: str, donors: int, timeout: float = 20.0, **kw) -> RemoteMemory:
        mem = RemoteMemory(broker=broker_url, **kw)
        mems.append(mem)
        wait_until(lambda: len(mem.donors()) >= donors, timeout, f"{donors} donors")
        return mem

    yield open_
    for mem in mems:
        mem.close()


@pytest.fixture
def control_factory() -> Callable[[str], ControlPlane]:
    """``open(broker_url)``: an operator's control plane (consumer id ``checker``), to send
    donors commands and read their state.  Closed at the end of the test."""
    planes: list[ControlPlane] = []

    def open_(broker_url: str) -> ControlPlane:
        ctl = ControlPlane(broker_url, "checker")
        planes.append(ctl)
        return ctl

    yield open_
    for ctl in planes:
        ctl.close()


@pytest.fixture
def local_cluster():
    """Three C slab servers in this process (tests/rdma/regions.py), for region engine tests without a
    broker.  ``local_cluster.region(nbytes, local_bytes, ...)`` -> (RemoteRegion, LocalCopies); the
    regions made are closed at the end of the test, before the servers stop."""
    from tests.rdma.regions import LocalCluster

    cluster = LocalCluster(3)
    made = []
    make = cluster.region

    def region(*a, **kw):
        r, io = make(*a, **kw)
        made.append(r)
        return r, io

    cluster.region = region
    yield cluster
    for r in made:
        r.close()
    cluster.close()
