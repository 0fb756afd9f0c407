"""The reclaim core's event convention (its policy is tested with remote memory, tests/rdma/test_mem_cores.py)."""

from __future__ import annotations

import nodesvc.reclaim
from nodesvc.reclaim import ForceUnmap, NotifyEvict, ReclaimCore, ReclaimRequested, SlabLent, Tick
from tests.core_conventions import assert_core_convention

MIB = 1 << 20


def test_events_and_decisions_follow_the_one_convention():
    assert_core_convention(nodesvc.reclaim)


def test_decisions_carry_the_stimulus_id_of_their_event():
    core = ReclaimCore(headroom_bytes=0, psi_threshold=50.0, deadline_s=2.0)
    core.handle(SlabLent("lend-1", 0.0, 1, "c", MIB))
    (note,) = core.handle(ReclaimRequested("ask-7", 1.0, MIB))
    assert isinstance(note, NotifyEvict) and note.stimulus_id == "ask-7"
    assert core.handle(Tick("tick-1", 2.9)) == []  # the deadline is 1.0 + 2.0
    (unmap,) = core.handle(Tick("tick-2", 3.0))
    assert isinstance(unmap, ForceUnmap) and unmap.stimulus_id == "tick-2"
    assert core.log == [("ask-7", "evict 1 (requested)"), ("tick-2", "unmap 1 after deadline")]
