"""Chunk placement: even splits, even shares with every server up, and only a dead server's chunks move."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.placement import MIN_SPLIT_BYTES, NoServer, Placement, split

SERVERS = ["10.0.0.1:7700", "10.0.0.2:7700", "10.0.0.3:7700", "10.0.0.4:7700"]


@given(numel=st.integers(1, 50_000_000), itemsize=st.sampled_from([2, 4]),
       chunk=st.sampled_from([4096, 64 << 10, 1 << 20, 4 << 20]), servers=st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_split_covers_the_key_exactly_with_chunks_no_larger_than_asked(numel, itemsize, chunk, servers):
    parts = split(numel, itemsize, chunk, servers)
    assert parts[0][0] == 0 and sum(n for _, n in parts) == numel
    assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
    assert all(0 < n * itemsize <= chunk for _, n in parts)
    assert len({n for _, n in parts[:-1]}) <= 1  # equal chunks, the last one may be shorter


def test_a_large_key_gets_a_whole_number_of_chunks_per_server():
    for k in (1, 2, 3, 4):
        parts = split(25_000_000, 4, 4 << 20, k)  # a 100 MB bucket
        assert len(parts) % k == 0
    # small keys are not cut below MIN_SPLIT_BYTES for balance's sake
    assert len(split(MIN_SPLIT_BYTES // 4, 4, 4 << 20, 4)) == 1


def test_every_server_gets_the_same_bytes_of_a_ddp_step():
    place = Placement(SERVERS, "job-a")
    load: Counter = Counter()
    for key, numel in enumerate([4_200_000, 16_800_000, 4_200_000, 260_000]):  # buckets of a 25M model
        for c, (_, n) in enumerate(split(numel, 4, 4 << 20, 4)):
            load[place.server_for(key, c)] += n * 4
    assert set(load) == set(SERVERS)
    assert max(load.values()) / min(load.values()) < 1.02


def test_losing_a_server_moves_only_its_chunks_and_spreads_them_over_the_rest():
    place = Placement(SERVERS, "job-b")
    items = [(k, c) for k in range(40) for c in range(24)]
    before = {i: place.server_for(*i) for i in items}
    dead = SERVERS[2]
    after = {i: place.server_for(*i, skip={dead}) for i in items}
    moved = [i for i in items if before[i] != after[i]]
    assert moved and all(before[i] == dead for i in moved)  # every other chunk stays put
    assert all(before[i] != dead or after[i] != dead for i in items)
    share = Counter(after[i] for i in moved)
    assert set(share) == set(SERVERS) - {dead} and min(share.values()) > 0.15 * len(moved)
    with pytest.raises(NoServer):
        place.server_for(0, 0, skip=set(SERVERS))


def test_every_rank_computes_the_same_placement_whatever_the_order_of_its_list():
    a, b = Placement(SERVERS, "j"), Placement(list(reversed(SERVERS)), "j")
    assert all(a.server_for(k, c, {SERVERS[0]}) == b.server_for(k, c, {SERVERS[0]})
               for k in range(30) for c in range(8))
    # different jobs start their stripes on different servers
    starts = {Placement(SERVERS, f"job{j}").server_for(0, 0) for j in range(20)}
    assert len(starts) > 1
