"""The consumer's control plane (rdma.control): reading donors' reports."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rdma.control import donor_view
from rdma.placement import DonorView

MIB = 1 << 20


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
                    max_leaves=15))
def test_donor_telemetry_parser_never_raises(report):
    v = donor_view("n1", report)
    if v is not None:
        assert v.slab_bytes > 0 and v.slab_bytes % 4096 == 0 and v.free_slabs >= 0


def test_donor_telemetry_parser_accepts_the_donor_report():
    good = {"enabled": True, "addr": "10.0.0.2:4100", "slab_bytes": MIB, "free_slabs": 3, "provider": "tcp"}
    assert donor_view("n1", good) == DonorView("n1", "10.0.0.2:4100", MIB, 3, True, "tcp")
    for bad in ({**good, "enabled": False}, {**good, "addr": "nohost"}, {**good, "addr": "h:99999"},
                {**good, "slab_bytes": 1000}, {**good, "free_slabs": -1}, {**good, "free_slabs": True},
                {**good, "slab_bytes": float("inf")}, None, []):
        assert donor_view("n1", bad) is None
