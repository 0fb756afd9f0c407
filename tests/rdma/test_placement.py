"""Placement (rdma.placement): power of two choices over the donors' free slabs, replicas on distinct donors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdma.placement import DonorView, NoDonorError, choose_one, place_replicas

MIB = 1 << 20


def donors(**free):
    return {n: DonorView(n, f"127.0.0.1:{i + 1000}", MIB, f) for i, (n, f) in enumerate(free.items())}


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
