"""Fixtures for remote-memory integration tests."""

from __future__ import annotations

import time

import pytest

from memhelpers import DonorProc, stop_proc


@pytest.fixture
def donor_factory(tmp_path):
    procs: list[DonorProc] = []

    def start(broker_url: str, n: int, prefix: str = "donor", **kw) -> list[DonorProc]:
        new = [DonorProc(f"{prefix}{len(procs) + i}", broker_url, tmp_path, **kw) for i in range(n)]
        procs.extend(new)
        return new

    yield start
    # Signal all first, then wait.  The daemon's clean stop currently waits ~5 s on
    # its final "offline" publish; the tests only need the processes gone.
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        stop_proc(p.proc, timeout=max(0.1, deadline - time.monotonic()))
        p.log.close()
