"""The clock of the C data plane."""

from __future__ import annotations

from rdma.native import lib


def monotonic_ns() -> int:
    """The clock the server stamps slab accesses with (CLOCK_MONOTONIC)."""
    return int(lib.dls_monotonic_ns())
