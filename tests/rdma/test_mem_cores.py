"""Pure cores of remote memory: placement and reclaim, with no network and a fake clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.reclaim import (
    ForceUnmap,
    NotifyEvict,
    PressureSample,
    ReclaimCore,
    ReclaimRequested,
    SlabAccessed,
    SlabLent,
    SlabReturned,
    Tick,
)
from rdma.placement import DonorView, NoDonorError, choose_one, place_replicas

MIB = 1 << 20


def donors(**free):
    return {n: DonorView(n, f"127.0.0.1:{i + 1000}", MIB, f) for i, (n, f) in enumerate(free.items())}


# --- placement -----------------------------------------------------------------------------

def test_two_choices_prefers_more_free_slabs():
    d = donors(a=1, b=100)
    rng = random.Random(0)
    assert all(choose_one(d, (), rng) == "b" for _ in range(50))


def test_two_choices_spreads_better_than_one_choice():
    """Filling 10 donors slab by slab: two choices keeps the fullest donor much closer to the mean."""
    def fill(two: bool, seed: int) -> int:
        free = {f"n{i}": 1000 for i in range(10)}
        rng = random.Random(seed)
        for _ in range(3000):
            view = {n: DonorView(n, "x:1", MIB, f) for n, f in free.items()}
            pick = choose_one(view, (), rng) if two else rng.choice(sorted(free))
            free[pick] -= 1
        used = [1000 - f for f in free.values()]
        return max(used) - min(used)

    two = sum(fill(True, s) for s in range(5))
    one = sum(fill(False, s) for s in range(5))
    assert two * 3 < one


def test_replicas_on_distinct_online_donors():
    d = donors(a=5, b=5, c=5)
    d["c"] = DonorView("c", "x:1", MIB, 5, online=False)
    for seed in range(20):
        picks = place_replicas(d, 2, random.Random(seed))
        assert sorted(picks) == ["a", "b"]
    with pytest.raises(NoDonorError):
        place_replicas(d, 3, random.Random(0))


def test_full_or_small_donors_are_skipped():
    d = donors(a=0, b=3)
    d["c"] = DonorView("c", "x:1", 4096, 50)
    assert choose_one(d, (), random.Random(1), min_slab_bytes=MIB) == "b"
    with pytest.raises(NoDonorError):
        choose_one(d, {"b"}, random.Random(1), min_slab_bytes=MIB)


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 5), min_size=1), st.integers(1, 4),
       st.integers(0, 2**32))
def test_placement_properties(free, k, seed):
    d = donors(**free)
    eligible = {n for n, f in free.items() if f > 0}
    try:
        picks = place_replicas(d, k, random.Random(seed))
    except NoDonorError:
        assert len(eligible) < k
        return
    assert len(set(picks)) == k and set(picks) <= eligible


# --- reclaim ---------------------------------------------------------------------------------

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


@settings(deadline=None)  # a loaded shared machine must not fail a property
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
                    max_leaves=15))
def test_donor_telemetry_parser_never_raises(report):
    from rdma.control import donor_view

    v = donor_view("n1", report)
    if v is not None:
        assert v.slab_bytes > 0 and v.slab_bytes % 4096 == 0 and v.free_slabs >= 0


def test_donor_telemetry_parser_accepts_the_donor_report():
    from rdma.control import donor_view

    good = {"enabled": True, "addr": "10.0.0.2:4100", "slab_bytes": MIB, "free_slabs": 3, "provider": "tcp"}
    assert donor_view("n1", good) == DonorView("n1", "10.0.0.2:4100", MIB, 3, True, "tcp")
    for bad in ({**good, "enabled": False}, {**good, "addr": "nohost"}, {**good, "addr": "h:99999"},
                {**good, "slab_bytes": 1000}, {**good, "free_slabs": -1}, {**good, "free_slabs": True},
                {**good, "slab_bytes": float("inf")}, None, []):
        assert donor_view("n1", bad) is None
