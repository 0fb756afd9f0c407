"""The donor's reclaim core (nodesvc.reclaim), pure: no network, a fake clock: its policy and its event convention."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nodesvc.reclaim
from nodesvc.reclaim import (
    ForceUnmap,
    MapGranted,
    MapRefused,
    MapRequested,
    NotifyEvict,
    PressureSample,
    ReclaimCore,
    ReclaimRequested,
    RenewRequested,
    Renewed,
    SlabAccessed,
    SlabLent,
    SlabReturned,
    Tick,
)
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



def core(**kw):
    return ReclaimCore(headroom_bytes=kw.pop("headroom", 100 * MIB), psi_threshold=kw.pop("psi", 10.0),
                       deadline_s=kw.pop("deadline", 2.0), **kw)


def lend(c, slabs, t=0.0):
    for s, last in slabs.items():
        c.handle(SlabLent(f"lend{s}", t, s, f"consumer{s % 2}", 10 * MIB))
        c.handle(SlabAccessed(f"acc{s}", t, s, last))


def test_no_pressure_no_eviction():
    c = core()
    lend(c, {1: 1.0, 2: 2.0})
    assert c.handle(PressureSample("p", 5.0, 500 * MIB, 0.0)) == []


def test_memavailable_shortfall_evicts_lru_first_until_covered():
    c = core()
    lend(c, {1: 5.0, 2: 1.0, 3: 3.0, 4: 4.0})
    out = c.handle(PressureSample("p1", 10.0, 85 * MIB, 0.0))  # 15 MiB short: two 10 MiB slabs
    assert [d.slab for d in out] == [2, 3]
    assert all(isinstance(d, NotifyEvict) and d.deadline_s == 2.0 and d.stimulus_id == "p1" for d in out)
    assert out[0].consumer == "consumer0"
    # the same shortfall again does not evict more: those two are on their way
    assert c.handle(PressureSample("p2", 10.5, 85 * MIB, 0.0)) == []
    # deeper shortfall: one more
    assert [d.slab for d in c.handle(PressureSample("p3", 11.0, 75 * MIB, 0.0))] == [4]


def test_ack_before_deadline_means_no_forced_unmap():
    c = core()
    lend(c, {1: 1.0, 2: 2.0})
    c.handle(ReclaimRequested("r", 0.0, 10 * MIB))
    c.handle(SlabReturned("ack", 0.5, 1))
    assert c.handle(Tick("t", 5.0)) == []
    assert c.evicting == []


def test_deadline_forces_unmap():
    c = core(deadline=1.0)
    lend(c, {1: 1.0, 2: 2.0})
    assert [d.slab for d in c.handle(ReclaimRequested("r", 0.0, 20 * MIB))] == [1, 2]
    assert c.handle(Tick("t1", 0.9)) == []
    out = c.handle(Tick("t2", 1.0))
    assert [(type(d), d.slab) for d in out] == [(ForceUnmap, 1), (ForceUnmap, 2)]
    assert c.leases == {}
    assert ("t2", "unmap 1 after deadline") in c.log


def test_psi_evicts_one_slab_per_cooldown():
    c = core(psi_cooldown_s=10.0)
    lend(c, {1: 1.0, 2: 2.0, 3: 3.0})
    out = c.handle(PressureSample("p1", 0.0, 500 * MIB, 25.0))
    assert [d.slab for d in out] == [1]
    c.handle(SlabReturned("ack", 0.1, 1))
    assert c.handle(PressureSample("p2", 5.0, 500 * MIB, 25.0)) == []  # cooling down
    assert [d.slab for d in c.handle(PressureSample("p3", 10.0, 500 * MIB, 25.0))] == [2]
    c.handle(SlabReturned("ack2", 10.2, 2))
    assert c.handle(PressureSample("p4", 30.0, 500 * MIB, 5.0)) == []  # below threshold


def test_recent_access_protects_a_slab():
    c = core()
    lend(c, {1: 1.0, 2: 2.0})
    c.handle(SlabAccessed("a", 3.0, 1, 3.0))  # slab 1 is now the most recent
    assert [d.slab for d in c.handle(ReclaimRequested("r", 4.0, 1))] == [2]


def test_unknown_event_is_a_type_error():
    with pytest.raises(TypeError):
        core().handle(object())  # type: ignore[arg-type]


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.lists(st.one_of(
    st.builds(lambda s, t: ("lend", s, t), st.integers(0, 9), st.floats(0, 100)),
    st.builds(lambda s, t: ("ret", s, t), st.integers(0, 9), st.floats(0, 100)),
    st.builds(lambda a, p, t: ("press", a, p, t), st.integers(0, 200), st.floats(0, 50), st.floats(0, 100)),
    st.builds(lambda t: ("tick", t), st.floats(0, 100)),
), max_size=60))
def test_reclaim_invariants(ops):
    """Whatever happens, a slab is notified at most once per lease and only unmapped after its deadline."""
    c = core(deadline=3.0)
    notified: dict[int, float] = {}
    t = 0.0
    for i, op in enumerate(ops):
        t = max(t, op[-1])
        if op[0] == "lend":
            if op[1] not in c.leases:
                c.handle(SlabLent(str(i), t, op[1], "c", 10 * MIB))
                notified.pop(op[1], None)
            continue
        if op[0] == "ret":
            c.handle(SlabReturned(str(i), t, op[1]))
            notified.pop(op[1], None)
            continue
        ev = PressureSample(str(i), t, op[1] * MIB, op[2]) if op[0] == "press" else Tick(str(i), t)
        for d in c.handle(ev):
            if isinstance(d, NotifyEvict):
                assert d.slab not in notified
                notified[d.slab] = t
            else:
                assert d.slab in notified and t >= notified[d.slab] + 3.0
                del notified[d.slab]
    assert sorted(c.evicting) == sorted(notified)


def test_lease_book_expires_only_silent_consumers():
    from nodesvc.reclaim import LeaseBook

    book = LeaseBook()
    book.renew("a", 0.0, 10.0)
    book.renew("b", 0.0, 10.0)
    book.renew("b", 8.0, 10.0)  # b renews
    book.renew("a", 1.0, 2.0)   # a shorter renewal never shortens the lease
    assert book.expired(9.9) == []
    assert book.expired(10.0) == ["a"]
    assert book.expired(17.9) == []
    assert book.expired(18.0) == ["b"]
    assert book.expiry == {}


def test_lease_book_touch_and_grace():
    from nodesvc.reclaim import LeaseBook

    lb = LeaseBook()
    lb.renew("c", 0.0, 10.0)
    lb.touch("c", 8.0)  # data-plane use renews
    assert lb.expired(15.0) == [] and lb.expired(18.0) == ["c"]
    lb.renew("d", 0.0, 10.0)
    lb.grace(30.0)
    assert lb.expired(35.0) == [] and lb.expired(40.0) == ["d"]
    lb.touch("nobody", 1.0)  # no lease, nothing to renew
    assert "nobody" not in lb.expiry


# --- what to lend, and consumer leases: decided in the core, not the shell -----------------------


def lender(**kw):
    return ReclaimCore(headroom_bytes=kw.pop("headroom", 100 * MIB), psi_threshold=10.0, deadline_s=2.0,
                       slab_bytes=10 * MIB, max_slabs=kw.pop("max_slabs", 8), **kw)


def test_a_map_is_admitted_whole_or_refused_with_what_is_lendable():
    c = lender(lend_reserved=False)
    # 100 MiB headroom + 30 MiB promised to local jobs + 25 MiB: two 10 MiB slabs are lendable
    (d,) = c.handle(MapRequested("m1", 0.0, "a", 3, 155 * MIB, reserved_unused=30 * MIB))
    assert isinstance(d, MapRefused) and d.stimulus_id == "m1" and "3 asked, 2 lendable" in d.reason
    (d,) = c.handle(MapRequested("m2", 0.0, "a", 2, 155 * MIB, reserved_unused=30 * MIB))
    assert d == MapGranted("a", 2, "m2")
    c.handle(SlabLent("m2", 0.0, 7, "a", 10 * MIB))
    c.handle(SlabLent("m2", 0.0, 8, "a", 10 * MIB))
    # MemAvailable has not moved (nothing written), but the two slabs are spoken for
    (d,) = c.handle(MapRequested("m3", 1.0, "b", 1, 155 * MIB, reserved_unused=30 * MIB))
    assert isinstance(d, MapRefused)
    # slab 7 written in full: its pages left MemAvailable, and it no longer counts as spoken for
    assert c.lendable_bytes(145 * MIB, 30 * MIB, {7: 10 * MIB}) == 5 * MIB
    # with lend_reserved, the reserved-but-unused memory is lent too
    c.lend_reserved = True
    assert c.lendable_bytes(155 * MIB, 30 * MIB, {}) == 35 * MIB


def test_max_slabs_and_a_drain_pause_refuse_maps():
    c = lender(max_slabs=1)
    big = 10 << 30
    assert isinstance(c.handle(MapRequested("m", 0.0, "a", 1, big))[0], MapGranted)
    c.handle(SlabLent("m", 0.0, 1, "a", 10 * MIB))
    assert isinstance(c.handle(MapRequested("m2", 0.0, "a", 1, big))[0], MapRefused)  # max_slabs
    c = lender()
    c.handle(ReclaimRequested("drain", 5.0, 1, pause_s=10.0))
    (d,) = c.handle(MapRequested("m3", 14.9, "a", 1, big))
    assert isinstance(d, MapRefused) and "paused" in d.reason
    assert isinstance(c.handle(MapRequested("m4", 15.0, "a", 1, big))[0], MapGranted)


def test_a_silent_consumer_loses_its_slabs_and_a_renewing_one_keeps_them():
    c = lender()
    for slab, who in ((1, "quiet"), (2, "quiet"), (3, "alive")):
        c.handle(SlabLent(f"l{slab}", 0.0, slab, who, 10 * MIB, lease_s=5.0))
    assert c.handle(RenewRequested("r1", 4.0, "alive", 5.0)) == [Renewed("alive", (3,), "r1")]
    assert c.handle(RenewRequested("r2", 4.0, "stranger", 5.0)) == [Renewed("stranger", (), "r2")]
    out = c.handle(PressureSample("p", 5.0, 10 << 30, 0.0))
    assert [(d.slab, d.consumer, d.reason, d.stimulus_id) for d in out] == [
        (1, "quiet", "consumer lease expired", "p"), (2, "quiet", "consumer lease expired", "p")]
    assert sorted(c.leases) == [3]
    assert c.handle(PressureSample("p2", 8.9, 10 << 30, 0.0)) == []
    (d,) = c.handle(PressureSample("p3", 9.0, 10 << 30, 0.0))
    assert isinstance(d, ForceUnmap) and d.slab == 3


def test_data_plane_use_renews_and_no_lease_expires_while_the_donor_is_cut_off():
    c = lender()
    c.handle(SlabLent("l", 0.0, 1, "a", 10 * MIB, lease_s=5.0))
    c.handle(SlabAccessed("acc", 4.0, 1, 4.0))  # reads and writes: alive
    assert c.handle(PressureSample("p", 8.9, 10 << 30, 0.0)) == []
    assert c.handle(PressureSample("p", 60.0, 10 << 30, 0.0, connected=False)) == []  # cut off: renewals can't come
    assert c.handle(PressureSample("p", 61.0, 10 << 30, 0.0)) == []  # back: a full lease from now
    assert c.handle(PressureSample("p", 65.9, 10 << 30, 0.0)) == []
    assert [d.slab for d in c.handle(PressureSample("p", 66.0, 10 << 30, 0.0))] == [1]


def test_a_returned_slab_ends_its_consumers_lease_when_it_was_the_last():
    c = lender()
    c.handle(SlabLent("l", 0.0, 1, "a", 10 * MIB, lease_s=5.0))
    c.handle(SlabLent("l", 0.0, 2, "a", 10 * MIB))
    c.handle(SlabReturned("u", 1.0, 1))
    assert "a" in c.consumers.expiry
    c.handle(SlabReturned("u", 1.0, 2))
    assert c.consumers.expiry == {} and c.lent_to() == {}
