"""bench/agg_timeline.py's step breakdown: the floor every rank's hand-overs set, with and without frame headers."""

from __future__ import annotations

import pytest

from bench import agg_timeline


def _worker(start: float, readies: list[tuple[float, int]], done: float) -> dict:
    # one warm-up round 0 (ignored) and the measured round 1
    buckets = [{"round": rnd, "key": k, "bytes": n, "ready": start + t, "done": start + done}
               for rnd in (0, 1) for k, (t, n) in enumerate(readies)]
    marks = [[start, start + 0.01, start + done, start + done + 0.01]] * 2
    return {"marks": marks, "buckets": buckets}


def test_the_floor_of_all_ranks_is_set_by_the_rank_that_hands_its_buckets_over_last():
    spb = 1e-6  # a microsecond a byte
    early = _worker(100.0, [(0.05, 100_000), (0.10, 200_000)], 0.50)
    late = _worker(100.0, [(0.05, 100_000), (0.25, 200_000)], 0.50)
    b = agg_timeline.breakdown(early, 1, s_per_byte=spb, peers=[late])
    # this rank alone: 0.05 + 0.3 s of bytes; the late rank: 0.25 + 0.2 s
    assert b["ready_floor"] == pytest.approx(350.0)
    assert b["ready_floor_all"] == pytest.approx(450.0)
    framed = 250.0 + 200.0 / agg_timeline.TCP_PAYLOAD_PER_FRAME
    assert b["framed_floor_all"] == pytest.approx(framed, abs=0.1)
    assert b["comm_over_framed_floor"] == pytest.approx(500.0 - framed, abs=0.1)


def test_without_peers_there_is_no_all_ranks_floor():
    b = agg_timeline.breakdown(_worker(5.0, [(0.05, 1000)], 0.2), 1, s_per_byte=1e-6)
    assert "ready_floor_all" not in b and b["ready_floor"] == pytest.approx(51.0)
