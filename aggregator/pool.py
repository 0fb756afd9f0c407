"""The elastic pool of reduction threads and its receive-buffer cache.

Threads take tasks from a :class:`~aggregator.scheduling.FairQueue` (deficit
round robin across jobs).  The number of threads follows
:class:`~aggregator.scheduling.PoolController`: a thread above the target exits
when it next looks for work, and new threads start at once when it grows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from aggregator.scheduling import FairQueue, PoolController, PoolSample

log = logging.getLogger("dlshare.agg.pool")


class BufferPool:
    """Reuses receive buffers by size, so steady-state rounds allocate nothing."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._cached = 0
        self._max = max_cached_bytes
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._cached -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def release(self, buf: bytearray) -> None:
        n = len(buf)
        with self._lock:
            if self._cached + n <= self._max:
                self._free.setdefault(n, []).append(buf)
                self._cached += n


class ElasticPool:
    def __init__(self, controller: PoolController, quantum: int = 1 << 20, name: str = "agg") -> None:
        self.controller = controller
        self.queue = FairQueue(quantum)
        self._cond = threading.Condition()
        self._live = 0
        self._target = controller.size
        self._busy_s = 0.0
        self._stopping = False
        self._name = name
        self._seq = 0
        self._started = time.monotonic()
        self._held_integral = 0.0
        self._held_since = self._started
        self.last_sample: PoolSample | None = None
        self.tasks_done = 0

    # --- work ---

    def submit(self, flow: Hashable, fn: Callable[[], Any], cost: int) -> None:
        with self._cond:
            self.queue.push(flow, fn, cost)
            self._cond.notify()

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping or self._live > self._target:
                        self._live -= 1
                        return
                    fn = self.queue.pop()
                    if fn is not None:
                        break
                    self._cond.wait()
            # CPU time of this thread, not wall time: a thread preempted on a busy machine is not
            # using a core, and counting its wait would grow the pool for nothing.
            t0 = time.thread_time()
            try:
                fn()
            except Exception:  # a failed task is reported by the task itself; the pool lives on
                log.exception("reduction task failed")
            dt = time.thread_time() - t0
            with self._cond:
                self._busy_s += dt
                self.tasks_done += 1

    # --- sizing ---

    def _account(self, now: float) -> None:
        self._held_integral += self._target * (now - self._held_since)
        self._held_since = now

    def resize(self, target: int) -> None:
        with self._cond:
            self._account(time.monotonic())
            self._target = target
            while self._live < self._target and not self._stopping:
                self._live += 1
                self._seq += 1
                threading.Thread(target=self._worker, name=f"{self._name}-pool-{self._seq}", daemon=True).start()
            self._cond.notify_all()

    def start(self) -> None:
        self.resize(self.controller.size)

    def observe(self, now: float) -> PoolSample:
        with self._cond:
            busy, queued = self._busy_s, len(self.queue)
        sample = self.controller.observe(now, busy, queued)
        self.last_sample = sample
        if sample.target != self._target:
            self.resize(sample.target)
        return sample

    @property
    def size(self) -> int:
        return self._target

    @property
    def busy_seconds(self) -> float:
        return self._busy_s

    def held_core_seconds(self, now: float | None = None) -> float:
        """Integral of the pool size over time up to ``now`` (for "cores reserved, time-averaged")."""
        with self._cond:
            self._account(max(self._held_since, time.monotonic() if now is None else now))
            return self._held_integral

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
