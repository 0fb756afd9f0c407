"""The elastic pool with real threads: it grows under load, shrinks when idle, and runs jobs fairly."""

from __future__ import annotations

import threading
import time

import numpy as np

from aggregator import kernel
from aggregator.pool import BufferPool, ElasticPool
from aggregator.protocol import DType
from aggregator.scheduling import PoolController
from nodesvc.bus.procs import wait_until


def test_pool_grows_under_load_and_shrinks_when_idle():
    pool = ElasticPool(PoolController(1, 3, shrink_after_s=0.3))
    pool.start()
    try:
        assert pool.size == 1
        # the pool grows from measured CPU time: on a machine whose cores are all taken its threads get a
        # fraction of one, so give it time (on a quiet machine it grows within the first second)
        deadline = time.monotonic() + 30
        t = time.monotonic()
        pool.observe(t)
        a = np.ones(1 << 20, np.float32)

        def summing() -> None:  # real reductions (GIL released), so busy time is CPU time
            for _ in range(20):
                kernel.add_(DType.F32, a, a)

        while time.monotonic() < deadline and pool.size < 2:
            while len(pool.queue) < 64:  # keep a backlog: the pool is saturated
                pool.submit("job", summing, 1)
            time.sleep(0.05)
            pool.observe(time.monotonic())
        assert pool.size >= 2
        wait_until(lambda: not len(pool.queue), timeout=60, what="the backlog to drain")

        def shrunk() -> bool:
            pool.observe(time.monotonic())
            return pool.size == 1

        wait_until(shrunk, timeout=5, interval=0.1, what="the idle pool to shrink to its minimum")
        wait_until(lambda: pool._live == 1, timeout=5, what="the surplus threads to exit")
        assert pool.held_core_seconds() > 0
    finally:
        pool.stop()


def test_pool_serves_a_small_job_between_a_large_jobs_tasks():
    pool = ElasticPool(PoolController(1, 1), quantum=1 << 20)
    gate = threading.Event()
    order: list[str] = []
    pool.start()
    try:
        blocked = threading.Event()
        pool.submit("big", lambda: (blocked.set(), gate.wait()), 1)
        assert blocked.wait(5)  # the only thread is now blocked in the gate
        for _ in range(20):
            pool.submit("big", lambda: order.append("big"), 4 << 20)
        for _ in range(3):
            pool.submit("small", lambda: order.append("small"), 64 << 10)
        gate.set()
        wait_until(lambda: len(order) == 23, timeout=10, interval=0.01, what="every task to run")
        assert order.index("small") <= 1 and order[:5].count("small") == 3
    finally:
        pool.stop()


def test_buffer_pool_reuses_by_size():
    bp = BufferPool(max_cached_bytes=1 << 20)
    a = bp.acquire(4096)
    bp.release(a)
    assert bp.acquire(4096) is a
    assert bp.acquire(4096) is not a
    big = bp.acquire(2 << 20)
    bp.release(big)  # over the cache limit: dropped
    assert bp.acquire(2 << 20) is not big
