"""SampleCache: a dataset's decoded samples, cached in local memory and on donors, shared by every
process of a job (DataLoader workers fork) and, by name and secret, by other jobs.

Index ``i`` of a map-style dataset has one slot in an index the job's processes share
(rdma.cache_state); an entry is stored once, by whichever process computed it, and found by
all the others and by later epochs.  Entries go into **segments**, filled one after another:

- the **local tier** is a shared memory file of ``local_bytes`` (the job's local budget), cut
  into segments;
- the **remote tier** is a set of slabs on donors, one slab per segment and copy
  (``replicas``, default 2, on different donors), mapped by the job's main process (the owner)
  through :class:`~rdma.remote.RemoteMemory`, which keeps their leases, fails over and rebuilds a
  lost copy elsewhere.  Every process reads and writes the slabs itself, through its own
  connections to the donors' slab servers, opened in that process (after the fork).

Placement: a private cache keeps an entry locally while the local tier has room, else on donors.
A **named** cache (``name=``, ``secret=``) keeps every entry on donors (the one copy other jobs
share) and, while there is room, locally too.  A full cache keeps what it has and stores no more
(``when_full="keep"``, the default: in epoch training every sample is read once per epoch, so
replacing entries costs writes and gains no hits; CoorDL's MinIO cache, Mohan et al., VLDB'21);
``when_full="evict"`` recycles the oldest full segment instead.  Either way a full cache never
fails a job: the sample is computed and returned, uncached.

Every entry carries its CRC-32C in its slot.  A read whose bytes do not match it, or whose
segment was lost (every copy of it) or recycled meanwhile, is a miss: the caller computes the
sample again and stores it again.  ``stats()`` counts each case.

Other jobs attach to a named cache read-only (:meth:`SampleCache.attach`): the owner publishes
its manifest (where the index and segments live, the slab tokens), sealed with the secret
(rdma.cache_manifest), retained on ``dlshare/v1/cache/<name>/manifest``, and copies its index to
donors as it changes.  An attached job reads entries from the donors and computes what is not
there; the donor memory is the owner's (its budget), and each reader's hits and misses are
reported back to the owner (``stats()["readers"]``).  The cache lives as long as its owner:
when the owner stops, attached readers carry on computing their samples.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from nodesvc.bus import messages
from nodesvc.bus.mqtt import Bus
from rdma import wire
from rdma.cache_manifest import (
    CopyRef,
    ManifestError,
    check_manifest,
    check_secret,
    copy_list,
    open_sealed,
    seal,
)
from rdma.cache_state import FILLING, FULL, H, LOST, SLOTS_PER_PAGE, SPARE, UNMAPPED, SharedState
from rdma.native import crc32c
from rdma.native_mem import Endpoint, RemoteMemoryError
from rdma.remote import RemoteMemory
from rdma.replica import EVICTING, LIVE, LOST as REP_LOST, REBUILDING

log = logging.getLogger("dlshare.rdma.cache")

MAX_ENTRY = 15 << 20  # one batched request carries at most 16 MiB (rdma.wire.MAX_PAYLOAD)
NONE = 2 ** 64 - 1
_STATE_NAMES = {LIVE: "live", REBUILDING: "rebuilding", EVICTING: "evicting"}
_abandoned: list[Any] = []  # a parent's connections, inherited by a fork: never used nor closed here


def cache_topic(name: str, leaf: str) -> str:
    return messages.topic("cache", name, leaf)


class CacheBus:
    """One MQTT connection in a thread, for a cache's manifest and reader reports."""

    def __init__(self, broker: str, client_id: str, subs: list[str],
                 on_message: Callable[[str, bytes], None] | None,
                 will: tuple[str, bytes, int, bool] | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready: Future = Future()
        self._on_message = on_message

        async def handler(topic: str, payload: bytes) -> None:
            if self._on_message is not None:
                await asyncio.to_thread(self._on_message, topic, payload)

        async def main() -> None:
            self._stop = asyncio.Event()
            self.bus = Bus(broker, client_id, [(s, 1) for s in subs], handler, will=will)
            task = asyncio.create_task(self.bus.run(self._stop))
            try:
                await asyncio.wait_for(self.bus.connected.wait(), timeout=20)
                self._ready.set_result(True)
            except Exception as exc:  # noqa: BLE001 - handed to the constructor
                self._ready.set_exception(ConnectionError(f"cannot reach broker {broker}: {exc!r}"))
                self._stop.set()
            await task

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="rdma-cache-bus", daemon=True)
        self._thread.start()
        self._ready.result(timeout=30)

    def publish(self, topic: str, payload: bytes, retain: bool = False, wait: bool = True) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.bus.publish(topic, payload, qos=1, retain=retain), self._loop)
        if wait:
            fut.result(10)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)


class SampleCache:
    """See the module docstring.

    ``slots``: the dataset's length (indices 0..slots-1).  ``local_bytes``: the local tier.
    ``remote_bytes``: donor memory, **every copy counted** (the job's remote budget), so the remote
    tier holds ``remote_bytes / replicas``; needs ``broker``.  ``name`` and ``secret``: share
    the cache with other jobs (see :meth:`attach`).  ``when_full``: "keep" or "evict".
    """

    def __init__(self, slots: int, local_bytes: int, remote_bytes: int = 0, *, broker: str | None = None,
                 name: str | None = None, secret: str | None = None, replicas: int = 2, when_full: str = "keep",
                 local_segment_bytes: int = 64 << 20, spare_segments: int = 2, consumer_id: str | None = None,
                 discover_timeout_s: float = 15.0, io_timeout_s: float = 5.0) -> None:
        if not isinstance(slots, int) or slots <= 0:
            raise ValueError(f"slots must be a positive whole number (the dataset's length), got {slots!r}")
        if local_bytes < 0 or remote_bytes < 0:
            raise ValueError("local_bytes and remote_bytes must not be negative")
        if when_full not in ("keep", "evict"):
            raise ValueError(f"when_full must be 'keep' or 'evict', got {when_full!r}")
        if remote_bytes and not broker:
            raise ValueError("remote_bytes needs a broker (where the donors are found)")
        if name is not None:
            messages.check_id(name, "cache name")
            if secret is None:
                raise ValueError("a named cache needs a secret: only jobs that know it may read it")
            check_secret(secret)
            if not remote_bytes:
                raise ValueError("a named cache lives on donors: give it remote_bytes")
        self.name, self._secret = name, secret
        self.slots = slots
        self.read_only = False
        self.when_full = when_full
        self.replicas = replicas
        self.io_timeout_ms = int(io_timeout_s * 1000)
        self._owner_pid = os.getpid()
        self._eps: dict[str, Endpoint] = {}
        self._eps_pid = os.getpid()
        self._copies: tuple[int, dict[int, tuple[CopyRef, ...]], list] = (-1, {}, [])
        self._readers: dict[str, dict[str, Any]] = {}
        self._closed = False
        self.mem: RemoteMemory | None = None
        self._segbufs: dict[int, Any] = {}
        self._index_buf = None
        self._bus: CacheBus | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._manifest_version = 0
        self._published_sig: Any = None
        self._sync_lock = threading.Lock()
        seg_bytes, rsegs = 0, 0
        try:
            if remote_bytes:
                self.mem = RemoteMemory(broker, replicas=replicas, consumer_id=consumer_id, checksums=False,
                                        discover_timeout_s=discover_timeout_s, io_timeout_s=io_timeout_s)
                donors = [d for d in self.mem.donors().values() if d.online]
                if len(donors) < replicas:
                    raise MemoryError(f"{len(donors)} donors online, {replicas} copies need as many")
                seg_bytes = min(d.slab_bytes for d in donors)
                per_copy = remote_bytes // replicas
                if name is not None:
                    index_bytes = -(-slots * 64 // self.mem.page_size) * self.mem.page_size
                    if index_bytes > per_copy:
                        raise ValueError(f"remote_bytes={remote_bytes} cannot hold the index of {slots} slots "
                                         f"({index_bytes} bytes a copy)")
                    self._index_buf = self.mem.alloc(index_bytes)
                    per_copy -= -(-index_bytes // seg_bytes) * seg_bytes  # the index's slabs count too
                rsegs = max(0, per_copy // seg_bytes)
            self.state = SharedState.create(slots, local_bytes, local_segment_bytes, rsegs, seg_bytes,
                                            named=name is not None)
            self.spare_segments = max(1, spare_segments)
            if self.mem is not None:
                self._tend()  # the first spare segments, before anything is stored
            if name is not None:
                self._bus = CacheBus(broker, f"dlshare-cache-{name}-{uuid.uuid4().hex[:8]}",
                                     [cache_topic(name, "readers")], self._on_reader_report,
                                     will=(cache_topic(name, "manifest"), b"", 1, True))
                self._publish_manifest(force=True)
            if self.mem is not None:
                self._keeper = threading.Thread(target=self._keep, name="rdma-cache-keeper", daemon=True)
                self._keeper.start()
        except BaseException:
            self.close()
            raise

    # --- attaching to a named cache --------------------------------------------------------------

    @classmethod
    def attach(cls, name: str, secret: str, broker: str, timeout_s: float = 10.0,
               io_timeout_s: float = 5.0, reader_id: str | None = None) -> "SampleCache":
        """Read-only use of the named cache another job filled (its owner must be running).

        Raises :class:`LookupError` when no cache of that name is published within ``timeout_s``,
        and :class:`~rdma.cache_manifest.ManifestError` when the secret does not open it."""
        messages.check_id(name, "cache name")
        check_secret(secret)
        self = cls.__new__(cls)
        self.name, self._secret, self.read_only = name, secret, True
        self.when_full, self.replicas = "keep", 0
        self.io_timeout_ms = int(io_timeout_s * 1000)
        self._owner_pid = os.getpid()
        self._eps, self._eps_pid = {}, os.getpid()
        self._copies = (-1, {}, [])
        self._readers, self._closed = {}, False
        self.mem, self._segbufs, self._index_buf = None, {}, None
        self._stop = threading.Event()
        self._keeper = None
        self._reader_id = reader_id or os.environ.get("DLSHARE_JOB") or f"reader-{uuid.uuid4().hex[:8]}"
        got: Future = Future()
        self._pending_manifest: list[bytes] = []

        def on_message(topic: str, payload: bytes) -> None:
            if topic != cache_topic(name, "manifest"):
                return
            if not got.done():
                got.set_result(payload)
            else:
                self._pending_manifest.append(payload)

        self._bus = CacheBus(broker, f"dlshare-cache-reader-{uuid.uuid4().hex[:8]}",
                             [cache_topic(name, "manifest")], on_message)
        try:
            try:
                payload = got.result(timeout=timeout_s)
            except TimeoutError:
                raise LookupError(f"no cache {name!r} is published on {broker} (its owner must be running)") \
                    from None
            man = self._open_manifest(payload)
            if man is None:
                raise LookupError(f"cache {name!r} was closed by its owner")
            self.slots = man.slots
            self.state = SharedState.create(man.slots, 0, 0, man.rsegs, man.seg_bytes, named=True, read_only=True)
            self._install_manifest(man)
            self._load_index(range(0, -(-man.slots // SLOTS_PER_PAGE)))
            self._keeper = threading.Thread(target=self._keep_reader, name="rdma-cache-reader", daemon=True)
            self._keeper.start()
        except BaseException:
            self.close()
            raise
        return self

    def _open_manifest(self, payload: bytes):
        if not payload:
            return None
        try:
            return check_manifest(open_sealed(messages.decode(payload), self.name, self._secret))
        except messages.PayloadError as exc:
            raise ManifestError(f"cache {self.name!r}: malformed manifest: {exc}") from None

    def _install_manifest(self, man) -> None:
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
        st = self.state
        with st.lock():
            st.rstate[:] = UNMAPPED
        st.write_table({"segments": {}, "index": [], "page": 4096})
        log.warning("cache %s: its owner closed it; samples are computed from here on", self.name)

    def _keep_reader(self) -> None:
        last: dict[str, int] = {}
        while not self._stop.wait(0.2):
            while self._pending_manifest:
                payload = self._pending_manifest.pop(0)
                try:
                    man = self._open_manifest(payload)
                except ManifestError as exc:
                    log.warning("cache %s: ignoring a manifest: %s", self.name, exc)
                    continue
                if man is None:
                    self._owner_gone()
                else:
                    self._install_manifest(man)
            now = self.state.totals()
            if now != last:
                self._report(now)
                last = now

    def _report(self, counters: dict[str, int], wait: bool = False) -> None:
        try:
            body = seal({"reader": self._reader_id, "counters": counters}, self.name, self._secret)
            self._bus.publish(cache_topic(self.name, "readers"), messages.encode(body), wait=wait)
        except Exception:  # noqa: BLE001 - a report is best effort
            log.debug("cache %s: reader report failed", self.name, exc_info=True)

    def _on_reader_report(self, topic: str, payload: bytes) -> None:
        try:
            doc = open_sealed(messages.decode(payload), self.name, self._secret)
        except (messages.PayloadError, ManifestError) as exc:
            log.info("cache %s: ignoring a reader report: %s", self.name, exc)
            return
        reader, counters = doc.get("reader"), doc.get("counters")
        if isinstance(reader, str) and len(reader) <= 128 and isinstance(counters, dict):
            self._readers[reader] = {k: v for k, v in counters.items()
                                     if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}

    # --- the mapping API -------------------------------------------------------------------------

    def get(self, index: int, tier: str | None = None) -> np.ndarray | None:
        """The bytes stored for ``index`` (a new uint8 array the caller owns), or None.
        ``tier``: "local" or "remote" reads only that tier's copy (to measure one)."""
        st = self.state
        self._check_index(index)
        rec = st.read_slot(index)
        if self.read_only and (rec is None or not rec["length"] or not self._remote_current(rec)):
            self._load_index([index // SLOTS_PER_PAGE])  # the owner may have stored it since
            rec = st.read_slot(index)
        if rec is None or not rec["length"]:
            st.count("misses")
            return None
        n, crc = int(rec["length"]), int(rec["crc"])
        if rec["lseg"] and tier != "remote":
            seg, gen, off = int(rec["lseg"]) - 1, int(rec["lgen"]), int(rec["loff"])
            if int(st.lgen[seg]) == gen:
                out = st.local[off:off + n].copy()
                if int(st.lgen[seg]) == gen and crc32c(out) == crc:
                    st.count("hits_local")
                    return out
                st.count("corrupt" if int(st.lgen[seg]) == gen else "stale")
        if rec["rseg"] and tier != "local":
            seg, gen = int(rec["rseg"]) - 1, int(rec["rgen"])
            if int(st.rgen[seg]) != gen or st.rstate[seg] in (UNMAPPED, LOST):
                st.count("lost" if int(st.rlost[seg]) == gen + 1 else "stale")
            else:
                out = self._read_remote(seg, gen, int(rec["roff"]), n, crc)
                if out is not None:
                    st.count("hits_remote")
                    st.count("bytes_read_remote", n)
                    return out
        st.count("misses")
        return None

    def put(self, index: int, data) -> str | None:
        """Store ``data`` (bytes-like) for ``index``; returns where ("local", "remote", "both") or
        None when it was not stored (cache full, too big, donors unreachable: counted)."""
        if self.read_only:
            raise PermissionError(f"cache {self.name!r} is attached read-only")
        self._check_index(index)
        st = self.state
        buf = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        n = len(buf)
        if n == 0 or n > MAX_ENTRY:
            st.count("too_big")
            return None
        crc = crc32c(buf)
        named = self.name is not None
        with st.lock():
            lpos = self._allocate("l", n)
            rpos = self._allocate("r", n) if (named or lpos is None) else None
        if lpos is None and rpos is None:
            st.count("full")
            return None
        if lpos is not None:  # the local tier's offsets are from its start
            lpos = (lpos[0], lpos[1], lpos[0] * int(st.head[H["lseg_bytes"]]) + lpos[2])
            st.local[lpos[2]:lpos[2] + n] = buf
        if rpos is not None and not self._write_remote(rpos[0], rpos[2], buf):
            st.count("store_failed")
            rpos = None
            if lpos is None:
                return None
        with st.lock():
            if lpos is not None and int(st.lgen[lpos[0]]) != lpos[1]:
                lpos = None  # recycled while we wrote
            if rpos is not None and int(st.rgen[rpos[0]]) != rpos[1]:
                rpos = None
            if lpos is None and rpos is None:
                return None
            st.write_slot(index, length=n, crc=crc,
                          lseg=lpos[0] + 1 if lpos else 0, lgen=lpos[1] if lpos else 0, loff=lpos[2] if lpos else 0,
                          rseg=rpos[0] + 1 if rpos else 0, rgen=rpos[1] if rpos else 0, roff=rpos[2] if rpos else 0)
        if lpos is not None:
            st.count("stores_local")
            st.count("bytes_stored_local", n)
        if rpos is not None:
            st.count("stores_remote")
            st.count("bytes_stored_remote", n)
        return "both" if lpos and rpos else "local" if lpos else "remote"

    def where(self, index: int) -> str | None:
        """"local", "remote", "both" or None, from the index (without reading the entry)."""
        self._check_index(index)
        rec = self.state.read_slot(index)
        if rec is None or not rec["length"]:
            return None
        loc = bool(rec["lseg"]) and int(self.state.lgen[int(rec["lseg"]) - 1]) == int(rec["lgen"])
        rem = bool(rec["rseg"]) and self._remote_current(rec)
        return "both" if loc and rem else "local" if loc else "remote" if rem else None

    def flush(self) -> None:
        """A named cache's owner: make every entry stored so far visible to attached jobs now (the
        owner's keeper does this every 50 ms anyway)."""
        if self.read_only or self.name is None:
            return
        with self._sync_lock:
            self._sync_index()
            self._publish_manifest()

    def entries(self) -> int:
        """Entries the index points to in a live segment (those recycled or lost since not counted)."""
        st = self.state
        s = st.slots
        ok = np.zeros(len(s), bool)
        for seg_f, gen_f, gens, states in (("lseg", "lgen", st.lgen, st.lstate), ("rseg", "rgen", st.rgen, st.rstate)):
            if not len(gens):
                continue
            seg = s[seg_f].astype(np.int64) - 1
            has = (seg >= 0) & (s["length"] > 0)
            idx = np.where(has, seg, 0)
            ok |= has & (gens[idx] == s[gen_f]) & (states[idx] != UNMAPPED) & (states[idx] != LOST)
        return int(np.count_nonzero(ok))

    def stats(self) -> dict[str, Any]:
        """Counters summed over every process of the job, and what the cache holds.  ``readers``
        (a named cache's owner): the latest counters each attached job reported."""
        st = self.state
        out: dict[str, Any] = st.totals()
        hits = out["hits_local"] + out["hits_remote"]
        reads = hits + out["misses"]
        out.update(
            role="reader" if self.read_only else "owner", name=self.name, slots=self.slots,
            entries=self.entries(), hit_rate=hits / reads if reads else None,
            local_bytes=int(len(st.local)), remote_segments=int(np.count_nonzero(st.rstate != UNMAPPED)),
            remote_bytes=int(np.count_nonzero(st.rstate != UNMAPPED)) * int(st.head[H["rseg_bytes"]]),
            replicas=self.replicas, processes=int(st.head[H["procs"]]), readers=dict(self._readers))
        if self.mem is not None:
            out["memory"] = dict(self.mem.stats)
        return out

    def close(self) -> None:
        """Give the donor memory back, withdraw the manifest, stop the threads.  In a forked worker
        this only drops the worker's own connections."""
        if os.getpid() != self._owner_pid:
            self._child_endpoints().clear()
            return
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(10)
        if self._bus is not None:
            try:
                if self.read_only:
                    self._report(self.state.totals(), wait=True)
                else:
                    self._bus.publish(cache_topic(self.name, "manifest"), b"", retain=True)
            except Exception:  # noqa: BLE001 - the broker may be gone
                log.info("cache %s: could not withdraw the manifest", self.name)
            self._bus.close()
        for ep in self._eps.values():
            ep.close()
        self._eps.clear()
        if self.mem is not None:
            self.mem.close()  # frees every segment and the index
        if getattr(self, "state", None) is not None:
            self.state.close()
            self.state = None

    def __enter__(self) -> "SampleCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        raise TypeError("a SampleCache reaches its workers by fork (the DataLoader's default on Linux); "
                        "it cannot be pickled (multiprocessing_context='spawn' or 'forkserver')")

    # --- internals: placement ----------------------------------------------------------------------

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.slots:
            raise IndexError(f"index {index} outside 0..{self.slots - 1}")

    def _remote_current(self, rec) -> bool:
        if not rec["rseg"]:
            return False
        seg = int(rec["rseg"]) - 1
        return int(self.state.rgen[seg]) == int(rec["rgen"]) and self.state.rstate[seg] not in (UNMAPPED, LOST)

    def _allocate(self, tier: str, n: int) -> tuple[int, int, int] | None:
        """(segment, generation, offset) for n bytes in the tier, or None (call under the lock)."""
        st = self.state
        gen, state, fill, order = ((st.lgen, st.lstate, st.lfill, st.lorder) if tier == "l"
                                   else (st.rgen, st.rstate, st.rfill, st.rorder))
        seg_bytes = int(st.head[H[f"{tier}seg_bytes"]])
        if n > seg_bytes or len(state) == 0:
            return None
        need = -(-n // 64) * 64
        cur = int(st.head[H[f"{tier}cur"]])
        if cur != NONE and state[cur] == FILLING and int(fill[cur]) + n <= seg_bytes:
            off = int(fill[cur])
            fill[cur] = off + need
            return cur, int(gen[cur]), off
        if cur != NONE and state[cur] == FILLING:
            state[cur] = FULL
            order[cur] = int(st.head[H["order"]])
            st.head[H["order"]] += np.uint64(1)
        spare = np.flatnonzero(state == SPARE)
        if len(spare):
            nxt = int(spare[0])
        elif self.when_full == "evict" and np.any(state == FULL):
            full = np.flatnonzero(state == FULL)
            nxt = int(full[np.argmin(order[full])])
            gen[nxt] = (int(gen[nxt]) + 1) & 0xFFFFFFFF
            st.count("evicted_segments")
        else:
            st.head[H[f"{tier}cur"]] = np.uint64(NONE)
            return None
        state[nxt] = FILLING
        fill[nxt] = need
        st.head[H[f"{tier}cur"]] = nxt
        return nxt, int(gen[nxt]), 0

    # --- internals: the remote tier's I/O (any process) -----------------------------------------------

    def _child_endpoints(self) -> dict[str, Endpoint]:
        if self._eps_pid != os.getpid():
            _abandoned.append(self._eps)  # the parent's: their C state may be mid-call in its threads
            self._eps, self._eps_pid = {}, os.getpid()
        return self._eps

    def _endpoint(self, addr: str) -> Endpoint:
        eps = self._child_endpoints()
        ep = eps.get(addr)
        if ep is None or ep.broken:
            if ep is not None:
                ep.close()
            host, _, port = addr.rpartition(":")
            ep = eps[addr] = Endpoint(host, int(port), timeout_ms=self.io_timeout_ms)
        return ep

    def _table(self) -> tuple[dict[int, tuple[CopyRef, ...]], list]:
        v = self.state.table_version()
        if v != self._copies[0]:
            v, doc = self.state.read_table()
            segs = {int(k): tuple(CopyRef(c[0], int(c[1]), bytes.fromhex(c[2]), c[3]) for c in cs)
                    for k, cs in doc.get("segments", {}).items()}
            index = [(int(e["first_page"]), int(e["npages"]),
                      tuple(CopyRef(c[0], int(c[1]), bytes.fromhex(c[2]), c[3]) for c in e["copies"]))
                     for e in doc.get("index", [])]
            self._copies = (v, segs, index)
        return self._copies[1], self._copies[2]

    @staticmethod
    def _segments(off: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        step = wire.MAX_SEG_BYTES
        offs = np.arange(off, off + n, step, dtype=np.uint64)
        lens = np.minimum(step, off + n - offs).astype(np.uint32)
        return offs, lens

    def _read_remote(self, seg: int, gen: int, off: int, n: int, crc: int) -> np.ndarray | None:
        copies = self._table()[0].get(seg, ())
        order = [c for c in copies if c.state == "live"] + [c for c in copies if c.state == "evicting"]
        offs, lens = self._segments(off, n)
        out = np.empty(n, np.uint8)
        for c in order:
            try:
                self._endpoint(c.addr).read(c.slab, c.token, offs, lens, out)
            except (RemoteMemoryError, ConnectionError, OSError) as exc:
                log.info("cache: reading segment %d from %s failed: %s", seg, c.addr, exc)
                self.state.count("read_errors")
                continue
            if int(self.state.rgen[seg]) != gen:
                self.state.count("stale")
                return None
            if crc32c(out) == crc:
                return out
            self.state.count("corrupt")
        return None

    def _write_remote(self, seg: int, off: int, buf: np.ndarray) -> bool:
        copies = self._table()[0].get(seg, ())
        offs, lens = self._segments(off, len(buf))
        durable = False
        for c in copies:
            try:
                self._endpoint(c.addr).write(c.slab, c.token, offs, lens, buf)
            except (RemoteMemoryError, ConnectionError, OSError) as exc:
                log.info("cache: writing segment %d to %s failed: %s", seg, c.addr, exc)
                continue
            durable = durable or c.state != "rebuilding"
        return durable

    def _load_index(self, pages) -> None:
        """Index pages of a named cache, from its copy on donors into this job's slots (readers)."""
        _, index = self._table()
        if not index:
            return
        P = 4096
        pages = sorted(set(int(p) for p in pages))
        for first, npages, copies in index:
            mine = [p for p in pages if first <= p < first + npages]
            for a in range(0, len(mine), 1024):
                chunk = mine[a:a + 1024]
                offs = np.array([(p - first) * P for p in chunk], np.uint64)
                lens = np.full(len(chunk), P, np.uint32)
                raw = np.empty(len(chunk) * P, np.uint8)
                for c in [c for c in copies if c.state == "live"] + [c for c in copies if c.state == "evicting"]:
                    try:
                        self._endpoint(c.addr).read(c.slab, c.token, offs, lens, raw)
                    except (RemoteMemoryError, ConnectionError, OSError):
                        self.state.count("read_errors")
                        continue
                    self.state.count("index_reads")
                    with self.state.lock():
                        for k, p in enumerate(chunk):
                            self.state.install_pages(p, raw[k * P:(k + 1) * P])
                    break

    # --- internals: the owner's keeper ---------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._tend()
                if self.name is not None:
                    self.flush()
            except Exception:  # noqa: BLE001 - the keeper must outlive any one failure
                if not self._stop.is_set():
                    log.exception("cache keeper")

    @staticmethod
    def _copy_refs(buf) -> list[CopyRef]:
        ext = buf.extents[0]
        return [CopyRef(r.addr, r.slab, r.token, _STATE_NAMES[r.state]) for r in list(ext.replicas)
                if r.state is not REP_LOST]

    def _tend(self) -> None:
        """Follow the copies of every segment, give up lost ones, keep spare segments mapped."""
        st = self.state
        changed = False
        for seg, buf in list(self._segbufs.items()):
            refs = self._copy_refs(buf)
            if not any(c.state in ("live", "evicting") for c in refs):
                with st.lock():
                    old = int(st.rgen[seg])
                    st.rlost[seg] = old + 1
                    st.rgen[seg] = (old + 1) & 0xFFFFFFFF
                    st.rstate[seg] = UNMAPPED
                    st.rfill[seg] = 0
                    if int(st.head[H["rcur"]]) == seg:
                        st.head[H["rcur"]] = np.uint64(NONE)
                lost = int(np.count_nonzero((st.slots["rseg"] == seg + 1) & (st.slots["rgen"] == old)))
                log.warning("cache: every copy of segment %d is gone (%d entries will be computed again)", seg, lost)
                del self._segbufs[seg]
                buf.free()
                changed = True
        spare = int(np.count_nonzero(st.rstate == SPARE))
        while spare < self.spare_segments and not self._stop.is_set():
            free = np.flatnonzero(st.rstate == UNMAPPED)
            if not len(free):
                break
            seg = int(free[0])
            try:
                buf = self.mem.alloc(int(st.head[H["rseg_bytes"]]))
            except (MemoryError, RemoteMemoryError, ConnectionError, TimeoutError) as exc:
                log.info("cache: no donor memory for another segment: %s", exc)
                break
            if len(buf.extents) != 1:
                buf.free()
                log.warning("cache: donors with smaller slabs than %d bytes; no segment mapped",
                            int(st.head[H["rseg_bytes"]]))
                break
            self._segbufs[seg] = buf
            with st.lock():
                st.rstate[seg] = SPARE
                st.rfill[seg] = 0
            spare += 1
            changed = True
        sig = {seg: self._copy_refs(b) for seg, b in self._segbufs.items()}
        if changed or sig != getattr(self, "_sig", None):
            self._sig = sig
            st.write_table({"segments": {str(k): copy_list(v) for k, v in sig.items()}, "index": [], "page": 4096})

    def _sync_index(self) -> None:
        st = self.state
        dirty = np.flatnonzero(st.dirty)
        if not len(dirty):
            return
        st.dirty[dirty] = 0
        P = 4096
        raw = np.zeros(len(dirty) * P, np.uint8)
        total = len(st.slot_bytes)
        for k, p in enumerate(dirty):
            a = int(p) * P
            chunk = st.slot_bytes[a:min(total, a + P)]
            raw[k * P:k * P + len(chunk)] = chunk
        try:
            self._index_buf.write_pages(dirty, raw)
        except Exception:  # noqa: BLE001 - try again next round
            st.dirty[dirty] = 1
            raise

    def _manifest_doc(self) -> dict[str, Any]:
        st = self.state
        segs = {str(seg): {"gen": int(st.rgen[seg]), "copies": copy_list(self._copy_refs(b))}
                for seg, b in self._segbufs.items() if self._copy_refs(b)}
        index = [{"first_page": e.first_page, "npages": e.npages,
                  "copies": copy_list([CopyRef(r.addr, r.slab, r.token, _STATE_NAMES[r.state])
                                       for r in list(e.replicas) if r.state is not REP_LOST])}
                 for e in self._index_buf.extents]
        return {"owner": self.mem.consumer_id, "slots": self.slots, "page": self.mem.page_size,
                "seg_bytes": int(st.head[H["rseg_bytes"]]), "rsegs": len(st.rgen), "index": index,
                "segments": segs}

    def _publish_manifest(self, force: bool = False) -> None:
        doc = self._manifest_doc()
        if not force and doc == self._published_sig:
            return
        self._published_sig = doc
        self._manifest_version += 1
        body = seal({**doc, "version": self._manifest_version}, self.name, self._secret)
        self._bus.publish(cache_topic(self.name, "manifest"), messages.encode(body), retain=True)


__all__ = ["SampleCache", "MAX_ENTRY", "cache_topic"]
