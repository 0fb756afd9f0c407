"""DRR fairness across jobs and the pool-size controller, with a fake clock."""

from __future__ import annotations

import pytest

from aggregator.scheduling import FairQueue, PoolController


def test_drr_small_job_is_not_starved_by_a_large_one():
    q = FairQueue(quantum=1 << 20)
    for i in range(100):
        q.push("big", ("big", i), 4 << 20)
    for i in range(10):
        q.push("small", ("small", i), 64 << 10)
    order = [q.pop() for _ in range(110)]
    assert q.pop() is None and len(q) == 0
    # the small job's whole backlog (640 KiB) fits in one turn's quantum, and the big job needs four
    # turns to afford one 4 MiB task: so no big task goes first, although it was queued first
    last_small = max(i for i, t in enumerate(order) if t[0] == "small")
    assert sum(1 for t in order[:last_small] if t[0] == "big") == 0
    # FIFO within a job
    assert [t[1] for t in order if t[0] == "big"] == list(range(100))


def test_drr_equal_bytes_for_backlogged_jobs():
    q = FairQueue(quantum=1 << 20)
    sizes = {"a": 1 << 20, "b": 256 << 10, "c": 3 << 20}
    for name, size in sizes.items():
        for _ in range(400):
            q.push(name, name, size)
    served = {k: 0 for k in sizes}
    for _ in range(300):
        name = q.pop()
        served[name] += sizes[name]
    # over a window, bytes served per backlogged job are equal within one large task
    assert max(served.values()) - min(served.values()) <= 3 << 20


def test_drr_rejects_bad_quantum():
    with pytest.raises(ValueError):
        FairQueue(0)


def test_pool_grows_under_load_and_shrinks_after_hold():
    c = PoolController(1, 8, shrink_after_s=1.0)
    busy, t = 0.0, 0.0
    c.observe(t, busy, 0)
    sizes = []
    for _ in range(8):  # 3 cores' worth of busy time per second
        t += 0.25
        busy += 0.75
        sizes.append(c.observe(t, busy, 0).target)
    assert sizes[0] >= 2 and max(sizes) <= 8
    assert sizes[-1] == 5  # ceil(3 / 0.7)
    # idle: nothing shrinks before the hold time, then it steps down to min
    t += 0.25
    assert c.observe(t, busy, 0).target == 5
    t += 0.5
    assert c.observe(t, busy, 0).target == 5
    for _ in range(12):
        t += 0.5
        c.observe(t, busy, 0)
    assert c.size == 1


def test_pool_hysteresis_keeps_size_in_the_band():
    c = PoolController(1, 8, shrink_after_s=1.0)
    c.observe(0.0, 0.0, 0)
    c.size = 4
    busy, t = 0.0, 0.0
    for _ in range(40):  # 60% busy on 4 threads: between shrink_below and grow_above
        t += 0.25
        busy += 0.25 * 4 * 0.6
        c.observe(t, busy, 0)
    assert c.size == 4


def test_pool_grows_on_backlog_and_respects_max():
    c = PoolController(2, 3)
    c.observe(0.0, 0.0, 0)
    assert c.observe(0.25, 0.0, queued=10).target == 2  # an idle pool with a momentary burst stays
    assert c.observe(0.5, 0.25, queued=10).target == 3  # 50% busy and a backlog: grow
    assert c.observe(0.75, 0.75, queued=10).target == 3  # never past max


def test_pool_rejects_bad_bounds():
    with pytest.raises(ValueError):
        PoolController(0, 2)
    with pytest.raises(ValueError):
        PoolController(3, 2)


def test_drr_late_small_job_overtakes_a_big_backlog():
    q = FairQueue(quantum=4 << 20)
    for i in range(50):
        q.push("big", ("big", i), 4 << 20)
    assert q.pop()[0] == "big"
    for i in range(4):
        q.push("small", ("small", i), 64 << 10)
    nxt = [q.pop()[0] for _ in range(6)]
    # FIFO would serve 49 big tasks first; DRR serves the small job on its next turn
    assert nxt.count("small") == 4 and nxt[:2].count("small") >= 1
