"""A consumer's connection to a donor's slab server, through a transport provider (csrc/provider.h)."""

from __future__ import annotations

import threading

import numpy as np

from rdma import wire
from rdma.errors import RemoteMemoryError
from rdma.native import ffi, lib

LOCAL_CRC = lib.DLS_F_LOCAL_CRC


class Endpoint:
    """One connection to a donor's slab server through a provider (``tcp`` here).

    Batches are pipelined in C; the calls block with the GIL released.  A
    connection that saw an I/O error or timeout is closed for good
    (``broken``); open a new one.
    """

    def __init__(self, host: str, port: int, provider: str = "tcp", timeout_ms: int = 5000) -> None:
        err, out = ffi.new("char[256]"), ffi.new("dls_ep **")
        rc = lib.dls_ep_connect(provider.encode(), host.encode(), int(port), int(timeout_ms), out, err, 256)
        if rc:
            raise ConnectionError(-rc, ffi.string(err).decode())
        self._ep = out[0]
        self.host, self.port, self.provider = host, port, provider
        self.timeout_ms = timeout_ms
        self.broken = False
        self._tokens: dict[bytes, object] = {}  # token -> its C copy, for the small-read path
        # Calls in flight: close() never frees the C endpoint under a thread that is using it;
        # the last such thread does, once close() was asked for.
        self._mu = threading.Lock()
        self._users = 0
        self._closing = False

    def _acquire(self, what: str):
        with self._mu:
            if self._ep is None or self._closing:
                raise RemoteMemoryError(wire.E_CLOSED, what)
            self._users += 1
            return self._ep

    def _release(self) -> None:
        with self._mu:
            self._users -= 1
            if self._closing and self._users == 0 and self._ep is not None:
                lib.dls_ep_close(self._ep)
                self._ep = None

    @staticmethod
    def _check_token(token: bytes) -> None:
        if not isinstance(token, (bytes, bytearray)) or len(token) != 16:
            raise ValueError("a slab token is exactly 16 bytes")

    def _batch(self, slab: int, token: bytes, offs: np.ndarray, lens: np.ndarray, buf, crc, crcs):
        self._check_token(token)
        b = ffi.new("dls_batch *")
        b.slab = slab
        tok = ffi.from_buffer(token)
        b.token = ffi.cast("uint8_t *", tok)
        b.nseg = len(offs)
        b.offs = ffi.cast("uint64_t *", ffi.from_buffer(offs))
        b.lens = ffi.cast("uint32_t *", ffi.from_buffer(lens))
        b.buf = ffi.cast("uint8_t *", buf)
        b.flags = crc if isinstance(crc, int) and not isinstance(crc, bool) else (wire.F_CRC if crc else 0)
        b.crcs = ffi.cast("uint32_t *", ffi.from_buffer(crcs)) if crcs is not None else ffi.NULL
        b.timeout_ms = self.timeout_ms
        return b, (tok,)

    def _call(self, fn, slab, token, offsets, lengths, buf, crc, crcs, what):
        offs = np.ascontiguousarray(offsets, dtype=np.uint64)
        lens = np.ascontiguousarray(lengths, dtype=np.uint32)
        if offs.shape != lens.shape or offs.ndim != 1:
            raise ValueError("offsets and lengths must be 1-D and of the same length")
        if crc and crcs is None:
            crcs = np.zeros(len(offs), dtype=np.uint32)
        if crcs is not None and not (isinstance(crcs, np.ndarray) and crcs.dtype == np.uint32
                                     and crcs.flags.c_contiguous and crcs.flags.writeable
                                     and crcs.size >= len(offs)):
            raise ValueError("crcs must be a writable C-contiguous uint32 array with one entry per segment")
        b, keep = self._batch(slab, token, offs, lens, buf, crc, crcs)
        ep = self._acquire(what)
        try:
            rc = fn(ep, b)
        finally:
            self._release()
        if rc < 0 and rc not in (wire.E_ARG,):
            self.broken = True
        if rc:
            err = RemoteMemoryError(rc, what)
            err.bad_segment = int(b.bad_seg)
            raise err
        return crcs

    def read(self, slab: int, token: bytes, offsets, lengths, out, crc: bool = False, crcs=None,
             local_crc: bool = False):
        """Read the segments back to back into ``out`` (a writable buffer, e.g. numpy).

        ``crc``: the donor checksums each segment and this side checks it (wire
        integrity); ``local_crc``: only this side computes each segment's CRC and
        returns them, for a caller that knows what the pages must hold."""
        if local_crc and not crc:
            crc = LOCAL_CRC
        buf = ffi.from_buffer(out, require_writable=True)
        need = int(np.sum(np.asarray(lengths, dtype=np.uint64)))
        if len(buf) < need:
            raise ValueError(f"out holds {len(buf)} bytes, the segments {need}")
        return self._call(lib.dls_ep_read, slab, token, offsets, lengths, buf, crc, crcs, f"read slab {slab}")

    def read_one(self, slab: int, token: bytes, offset: int, n: int, out, crc: bool = False,
                 local_crc: bool = False) -> int:
        """One segment into ``out`` with the least Python in the way; returns its CRC-32C
        (0 without ``crc``).  ``out`` must hold at least ``n`` bytes."""
        self._check_token(token)
        buf = ffi.from_buffer("uint8_t[]", out, require_writable=True)
        if len(buf) < n:
            raise ValueError(f"out holds {len(buf)} bytes, {n} asked")
        tok = self._tokens.get(token)
        if tok is None:
            if len(self._tokens) > 4096:
                self._tokens.clear()
            tok = self._tokens[token] = ffi.new("uint8_t[16]", token)
        crc_out = ffi.new("uint32_t *")  # per call: C writes it after releasing the endpoint's lock
        flags = wire.F_CRC if crc else (LOCAL_CRC if local_crc else 0)
        ep = self._acquire("read")
        try:
            rc = lib.dls_ep_read1(ep, slab, tok, offset, n, buf, flags, crc_out, self.timeout_ms)
        finally:
            self._release()
        if rc:
            if rc < 0 and rc != wire.E_ARG:
                self.broken = True
            raise RemoteMemoryError(rc, f"read slab {slab}")
        return int(crc_out[0])

    def write(self, slab: int, token: bytes, offsets, lengths, data, crc: bool = False, crcs=None,
              local_crc: bool = False):
        """Write the segments, taken back to back from ``data``.

        ``crc``: the donor checks each segment's CRC before storing it;
        ``local_crc``: only compute and return the CRCs (for the caller's table)."""
        if local_crc and not crc:
            crc = LOCAL_CRC
        buf = ffi.from_buffer(data)
        need = int(np.sum(np.asarray(lengths, dtype=np.uint64)))
        if len(buf) < need:
            raise ValueError(f"data holds {len(buf)} bytes, the segments {need}")
        return self._call(lib.dls_ep_write, slab, token, offsets, lengths, buf, crc, crcs, f"write slab {slab}")

    def ping(self) -> None:
        ep = self._acquire("ping")
        try:
            rc = lib.dls_ep_ping(ep, self.timeout_ms)
        finally:
            self._release()
        if rc:
            if rc < 0:
                self.broken = True
            raise RemoteMemoryError(rc, "ping")

    def close(self) -> None:
        """Close now if no call is in flight, else as soon as the last one returns."""
        mu = getattr(self, "_mu", None)
        if mu is None:  # __init__ failed before the lock existed
            return
        with mu:
            self._closing = True
            if self._users == 0 and self._ep is not None:
                lib.dls_ep_close(self._ep)
                self._ep = None

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def provider_available(name: str) -> bool:
    return bool(lib.dls_provider_available(name.encode()))
