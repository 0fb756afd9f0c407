"""What a client has in flight: reductions (:class:`Allreduce`), their chunks (:class:`Unit`), and the errors.

An :class:`Allreduce` is one ``allreduce`` call.  It is cut into :class:`Unit` s, one
per chunk, each sent to one server.  With failover on, a unit keeps a copy of
the bytes it pushed (taken just before the push) until a later round of this
rank completes: if its server dies, the copy is pushed again to the chunk's
next server, whether or not this rank already has the result (a peer may still
be waiting for it).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aggregator.protocol import DType, Op as ReduceOp


class AggregationError(RuntimeError):
    """A round that could not complete; the message says why (from the server when it knows)."""

    def __init__(self, message: str, code: str = "error", round: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.round = round


@dataclass(eq=False)
class Allreduce:
    """One all-reduce of one tensor, in place; ``future`` resolves to ``target``."""

    target: Any
    data: np.ndarray  # uint8 view of target
    dtype: DType
    op: ReduceOp
    round: int
    key: int
    numel: int
    future: Future
    started: float
    nchunks: int = 0
    left: int = 0
    done: bool = False
    ok: bool = False
    wire: DType | None = None  # the dtype on the wire, when it differs from ``dtype`` (compression)
    ready_t: float = 0.0  # tracing: wall-clock time the caller handed it over
    units: list | None = None  # tracing: its chunks, for their stage times
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def wire_dtype(self) -> DType:
        return self.dtype if self.wire is None else self.wire

    def fail(self, exc: AggregationError) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        self.future.set_exception(exc)

    def chunk_done(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left or self.done:
                return
            self.done = self.ok = True
        self.future.set_result(self.target)


@dataclass(eq=False)
class Unit:
    """One chunk of an :class:`Allreduce` on its way to, or kept for, one server."""

    op: Allreduce
    chunk: int
    offset: int  # bytes into op.data
    nbytes: int  # payload bytes on the wire (elements x the wire dtype's size)
    numel: int  # elements of the whole key (the wire's check of shapes)
    copy: bytearray | None = None  # what was pushed, for a retry elsewhere
    done: bool = False  # the server answered it
    contrib: bool = False  # pushed again only so that peers can finish; its result is not used here
    server: str = ""  # where it was last queued
    times: list[float] | None = None  # tracing: push started, push done, result started, result done

    @property
    def uid(self) -> tuple[int, int, int]:
        return (self.op.round, self.op.key, self.chunk)

    def local(self) -> memoryview:
        """This chunk's bytes in the caller's tensor (in its own dtype)."""
        n = self.nbytes // self.op.wire_dtype.itemsize * self.op.dtype.itemsize
        return memoryview(self.op.data)[self.offset:self.offset + n]

    def payload(self) -> memoryview:
        if self.copy is not None:
            return memoryview(self.copy)
        return self.local()

    def needed(self) -> bool:
        """Still worth sending: a live reduction of ours, or a contribution peers may wait for."""
        return self.contrib or not self.op.done


class CopyPool:
    """Reuses the byte buffers that hold pushed chunks, so steady rounds allocate nothing."""

    def __init__(self, max_cached_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._cached = 0
        self._max = max_cached_bytes
        self._lock = threading.Lock()

    def take(self, src: memoryview) -> bytearray:
        buf = self.empty(len(src))
        buf[:] = src
        return buf

    def empty(self, n: int) -> bytearray:
        """A buffer of ``n`` bytes (contents undefined)."""
        with self._lock:
            free = self._free.get(n)
            buf = free.pop() if free else None
            if buf is not None:
                self._cached -= n
        if buf is None:
            buf = bytearray(n)
        return buf

    def give(self, buf: bytearray | None) -> None:
        if buf is None:
            return
        n = len(buf)
        with self._lock:
            if self._cached + n <= self._max:
                self._free.setdefault(n, []).append(buf)
                self._cached += n
