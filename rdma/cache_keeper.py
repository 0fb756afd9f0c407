"""The threads behind a sample cache, in the job's main process: the owner's keeper and a reader's.

:class:`OwnerKeeper` (the job that fills the cache) maps the remote tier's segments on donors through
its :class:`~rdma.remote.RemoteMemory` (one slab per copy and segment; the memory keeps their leases,
fails over and rebuilds lost copies), keeps a few spare segments mapped ahead of the writers, writes
the segments' copies into the shared table whenever they change, and gives up a segment whose every
copy is gone (its entries read as lost).  For a named cache it also copies changed index pages to
the index on donors and publishes the sealed manifest, and collects the readers' reports.

:class:`ReaderKeeper` (a job attached to a named cache) follows the owner's manifest and reports
this job's counters back to the owner.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from concurrent.futures import Future
from typing import Any

import numpy as np

from nodesvc.bus import messages
from rdma.cache_bus import CacheBus, cache_topic
from rdma.cache_manifest import CopyRef, Manifest, ManifestError, check_manifest, copy_list, open_sealed, seal
from rdma.cache_state import FULL, H, SPARE, UNMAPPED, SharedState
from rdma.errors import RemoteMemoryError
from rdma.remote import RemoteMemory
from rdma.replica import EVICTING, LIVE, LOST, REBUILDING

log = logging.getLogger("dlshare.rdma.cache")

NONE = 2 ** 64 - 1
TICK_S = 0.05  # the owner's keeper: how soon a new segment, a changed copy or a stored entry is followed
_STATE_NAMES = {LIVE: "live", REBUILDING: "rebuilding", EVICTING: "evicting"}


def _copy_refs(extent) -> list[CopyRef]:
    return [CopyRef(r.addr, r.slab, r.token, _STATE_NAMES[r.state]) for r in list(extent.replicas)
            if r.state is not LOST]


class OwnerKeeper:
    """See the module docstring.  :meth:`plan` sizes the remote tier before the shared state exists;
    :meth:`start` begins once it does."""

    def __init__(self, mem: RemoteMemory, name: str | None, secret: str | None, spare_segments: int) -> None:
        self.mem = mem
        self.name, self._secret = name, secret
        self.spare_segments = max(1, spare_segments)
        self.segbufs: dict[int, Any] = {}
        self.index_buf = None
        self.readers: dict[str, dict[str, int]] = {}
        self.bus: CacheBus | None = None
        self.state: SharedState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self._table_lock = threading.Lock()
        self._sig: Any = None
        self._published: Any = None
        self._version = 0
        self._too_big = False

    def plan(self, slots: int, remote_bytes: int) -> tuple[int, int]:
        """(segment bytes, segments) for ``remote_bytes`` of donor memory, every copy counted; a named
        cache's index on donors is mapped here and counts too."""
        donors = [d for d in self.mem.donors().values() if d.online]
        if len(donors) < self.mem.replicas:
            raise MemoryError(f"{len(donors)} donors online, {self.mem.replicas} copies need as many")
        seg_bytes = min(d.slab_bytes for d in donors)
        per_copy = remote_bytes // self.mem.replicas
        if self.name is not None:
            page = self.mem.page_size
            index_bytes = -(-slots * 64 // page) * page
            if index_bytes > per_copy:
                raise ValueError(f"remote_bytes={remote_bytes} cannot hold the index of {slots} slots "
                                 f"({index_bytes} bytes a copy)")
            self.index_buf = self.mem.alloc(index_bytes)
            per_copy -= -(-index_bytes // seg_bytes) * seg_bytes
        return seg_bytes, max(0, per_copy // seg_bytes)

    def start(self, state: SharedState, slots: int, broker: str) -> None:
        self.state = state
        self.slots = slots
        self.tend()  # the first spare segments, before anything is stored
        if self.name is not None:
            self.bus = CacheBus(broker, f"dlshare-cache-{self.name}-{uuid.uuid4().hex[:8]}",
                                [cache_topic(self.name, "readers")], self._on_report,
                                will=(cache_topic(self.name, "manifest"), b"", 1, True))
            self.publish(force=True)
        self._thread = threading.Thread(target=self._run, name="rdma-cache-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tend()
                self.flush()
            except Exception:  # noqa: BLE001 - the keeper must outlive any one failure
                if not self._stop.is_set():
                    log.exception("cache keeper")

    # --- segments ------------------------------------------------------------------------------------

    def tend(self) -> None:
        """Follow the copies of every segment, give up lost ones, keep spare segments mapped."""
        st = self.state
        changed = False
        for seg, buf in list(self.segbufs.items()):
            if not any(c.state in ("live", "evicting") for c in _copy_refs(buf.extents[0])):
                with st.lock():
                    old = int(st.rgen[seg])
                    st.rlost[seg] = int(st.rlost[seg]) | (1 << (old % 64))
                    st.rgen[seg] = (old + 1) & 0xFFFFFFFF
                    st.rstate[seg] = UNMAPPED
                    st.rfill[seg] = 0
                    if int(st.head[H["rcur"]]) == seg:
                        st.head[H["rcur"]] = np.uint64(NONE)
                lost = int(np.count_nonzero((st.slots["rseg"] == seg + 1) & (st.slots["rgen"] == old)))
                log.warning("cache: every copy of segment %d is gone (%d entries will be computed again)", seg, lost)
                del self.segbufs[seg]
                buf.free()
                changed = True
        spare = int(np.count_nonzero(st.rstate == SPARE))
        seg_bytes = int(st.head[H["rseg_bytes"]])
        while spare < self.spare_segments and not self._stop.is_set():
            free = np.flatnonzero(st.rstate == UNMAPPED)
            if not len(free):
                break
            seg = int(free[0])
            try:
                buf = self.mem.alloc(seg_bytes)
            except (MemoryError, RemoteMemoryError, ConnectionError, TimeoutError) as exc:
                log.info("cache: no donor memory for another segment: %s", exc)
                break
            if len(buf.extents) != 1:
                buf.free()
                log.warning("cache: donors with slabs smaller than %d bytes; no segment mapped", seg_bytes)
                break
            buf.on_replicas_changed = self._copies_changed
            self.segbufs[seg] = buf
            with st.lock():
                st.rstate[seg] = SPARE
                st.rfill[seg] = 0
            spare += 1
            changed = True
        self._write_table(changed)

    def _write_table(self, force: bool = False) -> None:
        """The copies of every segment into the shared table, when they changed (or ``force``)."""
        with self._table_lock:
            sig = {seg: _copy_refs(b.extents[0]) for seg, b in list(self.segbufs.items())}
            if force or sig != self._sig:
                self._sig = sig
                self.state.write_table({"segments": {str(k): copy_list(v) for k, v in sig.items()}, "index": [],
                                        "page": 4096})

    def _copies_changed(self, ext) -> None:
        """RemoteMemory moved a segment's copies (a rebuild, a reclaim), before it gives an old one
        back: the table follows now, not at the next tick, so a reader that finds the old copy gone
        finds the new one listed (a reclaim costs no sample computed again)."""
        if not self._stop.is_set() and self.state is not None:
            self._write_table()

    # --- a named cache: index on donors, manifest, readers ---------------------------------------------

    def flush(self) -> None:
        if self.name is None:
            return
        with self._sync_lock:
            self._sync_index()
            self.publish()

    def _sync_index(self) -> None:
        st = self.state
        dirty = np.flatnonzero(st.dirty)
        if not len(dirty):
            return
        st.dirty[dirty] = 0  # before copying: a slot written meanwhile marks its page again
        P = 4096
        raw = np.zeros(len(dirty) * P, np.uint8)
        total = len(st.slot_bytes)
        for k, p in enumerate(dirty):
            a = int(p) * P
            chunk = st.slot_bytes[a:min(total, a + P)]
            raw[k * P:k * P + len(chunk)] = chunk
        try:
            self.index_buf.write_pages(dirty, raw)
        except Exception:
            st.dirty[dirty] = 1  # try again next round
            raise

    def _manifest(self) -> dict[str, Any]:
        st = self.state
        segs = {}
        for seg, b in self.segbufs.items():
            refs = _copy_refs(b.extents[0])
            if refs:
                segs[str(seg)] = {"gen": int(st.rgen[seg]), "copies": copy_list(refs)}
        index = [{"first_page": e.first_page, "npages": e.npages, "copies": copy_list(_copy_refs(e))}
                 for e in self.index_buf.extents]
        return {"owner": self.mem.consumer_id, "slots": self.slots, "page": self.mem.page_size,
                "seg_bytes": int(st.head[H["rseg_bytes"]]), "rsegs": len(st.rgen), "index": index,
                "segments": segs}

    def publish(self, force: bool = False) -> None:
        doc = self._manifest()
        if not force and doc == self._published:
            return
        self._published = doc
        self._version += 1
        copies = self.mem.replicas
        donor = (len(self.segbufs) * int(self.state.head[H["rseg_bytes"]]) + self.index_buf.nbytes) * copies
        public = {"owner": self.mem.consumer_id, "slots": self.slots, "donor_bytes": donor, "copies": copies}
        body = seal({**doc, "version": self._version}, self.name, self._secret, public=public)
        payload = messages.encode(body)
        if len(payload) > messages.MAX_PAYLOAD:  # readers would refuse it; the cache still serves this job
            if not self._too_big:
                log.error("cache %s: its manifest (%d segments) exceeds %d bytes: other jobs cannot attach; "
                          "use donors with larger slabs", self.name, len(self.segbufs), messages.MAX_PAYLOAD)
                self._too_big = True
            return
        self.bus.publish(cache_topic(self.name, "manifest"), payload, retain=True)

    def _on_report(self, topic: str, payload: bytes) -> None:
        try:
            doc = open_sealed(messages.decode(payload), self.name, self._secret)
        except (messages.PayloadError, ManifestError) as exc:
            log.info("cache %s: ignoring a reader report: %s", self.name, exc)
            return
        reader, counters = doc.get("reader"), doc.get("counters")
        if isinstance(reader, str) and len(reader) <= 128 and isinstance(counters, dict):
            self.readers[reader] = {k: v for k, v in counters.items()
                                    if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}

    def close(self) -> None:
        """Stop, withdraw the manifest, give the donor memory back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.bus is not None:
            try:
                self.bus.publish(cache_topic(self.name, "manifest"), b"", retain=True)
            except Exception:  # noqa: BLE001 - the broker may be gone (the Last Will withdraws it then)
                log.info("cache %s: could not withdraw the manifest", self.name)
            self.bus.close()
        self.mem.close()  # frees every segment and the index


class ReaderKeeper:
    """See the module docstring.  :meth:`connect` waits for the manifest (LookupError if none)."""

    def __init__(self, name: str, secret: str, broker: str, reader_id: str | None) -> None:
        self.name, self._secret = name, secret
        self.reader_id = reader_id or os.environ.get("DLSHARE_JOB") or f"reader-{uuid.uuid4().hex[:8]}"
        self.state: SharedState | None = None
        self._first: Future = Future()
        self._pending: list[bytes] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bus = CacheBus(broker, f"dlshare-cache-reader-{uuid.uuid4().hex[:8]}",
                            [cache_topic(name, "manifest")], self._on_manifest)
        self.broker = broker

    def _on_manifest(self, topic: str, payload: bytes) -> None:
        if topic != cache_topic(self.name, "manifest"):
            return
        if not self._first.done():
            self._first.set_result(payload)
        else:
            self._pending.append(payload)

    def first_manifest(self, timeout_s: float) -> Manifest:
        try:
            payload = self._first.result(timeout=timeout_s)
        except TimeoutError:
            raise LookupError(f"no cache {self.name!r} is published on {self.broker} (its owner must be running)") \
                from None
        man = self._open(payload)
        if man is None:
            raise LookupError(f"cache {self.name!r} was closed by its owner")
        return man

    def _open(self, payload: bytes) -> Manifest | None:
        if not payload:
            return None
        try:
            return check_manifest(open_sealed(messages.decode(payload), self.name, self._secret))
        except messages.PayloadError as exc:
            raise ManifestError(f"cache {self.name!r}: malformed manifest: {exc}") from None

    def install(self, man: Manifest) -> None:
        st = self.state
        with st.lock():
            seen = np.zeros(len(st.rgen), bool)
            for seg, ref in man.segments.items():
                if seg < len(st.rgen):
                    st.rgen[seg] = ref.gen
                    st.rstate[seg] = FULL
                    seen[seg] = True
            st.rstate[~seen] = UNMAPPED
        st.write_table({"segments": {str(k): copy_list(v.copies) for k, v in man.segments.items()},
                        "index": [{"first_page": e.first_page, "npages": e.npages, "copies": copy_list(e.copies)}
                                  for e in man.index], "page": man.page})

    def _owner_gone(self) -> None:
        with self.state.lock():
            self.state.rstate[:] = UNMAPPED
        self.state.write_table({"segments": {}, "index": [], "page": 4096})
        log.warning("cache %s: its owner closed it; samples are computed from here on", self.name)

    def start(self, state: SharedState) -> None:
        self.state = state
        self._thread = threading.Thread(target=self._run, name="rdma-cache-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[str, int] = {}
        while not self._stop.wait(0.2):
            while self._pending:
                try:
                    man = self._open(self._pending.pop(0))
                except ManifestError as exc:
                    log.warning("cache %s: ignoring a manifest: %s", self.name, exc)
                    continue
                if man is None:
                    self._owner_gone()
                else:
                    self.install(man)
            now = self.state.totals()
            if now != last:
                self.report(now)
                last = now

    def report(self, counters: dict[str, int], wait: bool = False) -> None:
        try:
            body = seal({"reader": self.reader_id, "counters": counters}, self.name, self._secret)
            self.bus.publish(cache_topic(self.name, "readers"), messages.encode(body), wait=wait)
        except Exception:  # noqa: BLE001 - a report is best effort
            log.debug("cache %s: reader report failed", self.name, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            if self.state is not None and self.state.head is not None:
                self.report(self.state.totals(), wait=True)
        self.bus.close()


__all__ = ["OwnerKeeper", "ReaderKeeper"]
