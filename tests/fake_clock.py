"""A clock a test moves by hand, for shells that take an injected clock (their timeouts then run in
milliseconds of real time, not in seconds of sleeping)."""

from __future__ import annotations

import threading


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._t += seconds
            return self._t
