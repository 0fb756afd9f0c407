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

import os
from typing import Any

import numpy as np

from nodesvc.bus import messages
from rdma.cache_keeper import OwnerKeeper, ReaderKeeper
from rdma.cache_manifest import check_secret
from rdma.cache_remote import RemoteTier
from rdma.cache_state import FILLING, FULL, H, LOST, SLOTS_PER_PAGE, SPARE, UNMAPPED, SharedState, lost_at
from rdma.native import crc32c
from rdma.remote import RemoteMemory

MAX_ENTRY = 15 << 20  # one batched request carries at most 16 MiB (rdma.wire.MAX_PAYLOAD)
NONE = 2 ** 64 - 1


class SampleCache:
    """See the module docstring.

    ``slots``: the dataset's length (indices 0..slots-1).  ``local_bytes``: the local tier.
    ``remote_bytes``: donor memory, **every copy counted** (the job's remote budget), so the remote
    tier holds ``remote_bytes / replicas``; needs ``broker``.  ``name`` and ``secret``: share
    the cache with other jobs (see :meth:`attach`).  ``when_full``: "keep" or "evict".
    ``rebuild_bytes_per_s``: the cap on rebuilding a lost copy (:class:`~rdma.remote.RemoteMemory`).
    """

    def __init__(self, slots: int, local_bytes: int, remote_bytes: int = 0, *, broker: str | None = None,
                 name: str | None = None, secret: str | None = None, replicas: int = 2, when_full: str = "keep",
                 local_segment_bytes: int = 64 << 20, spare_segments: int = 2, consumer_id: str | None = None,
                 discover_timeout_s: float = 15.0, io_timeout_s: float = 5.0, rebuild_bytes_per_s: float = 0) -> None:
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
        self.name = name
        self.slots = slots
        self.read_only = False
        self.when_full = when_full
        self.replicas = replicas
        self._owner_pid = os.getpid()
        self._closed = False
        self.state: SharedState | None = None
        self.remote: RemoteTier | None = None
        self.mem: RemoteMemory | None = None
        self.keeper: OwnerKeeper | ReaderKeeper | None = None
        try:
            seg_bytes, rsegs = 0, 0
            if remote_bytes:
                self.mem = RemoteMemory(broker, replicas=replicas, consumer_id=consumer_id, checksums=False,
                                        discover_timeout_s=discover_timeout_s, io_timeout_s=io_timeout_s,
                                        rebuild_bytes_per_s=rebuild_bytes_per_s)
                self.keeper = OwnerKeeper(self.mem, name, secret, spare_segments)
                seg_bytes, rsegs = self.keeper.plan(slots, remote_bytes)
            self.state = SharedState.create(slots, local_bytes, local_segment_bytes, rsegs, seg_bytes,
                                            named=name is not None)
            self.remote = RemoteTier(self.state, int(io_timeout_s * 1000))
            if self.keeper is not None:
                self.keeper.start(self.state, slots, broker)
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
        self.name, self.read_only, self.when_full, self.replicas = name, True, "keep", 0
        self._owner_pid, self._closed = os.getpid(), False
        self.state, self.remote, self.mem = None, None, None
        self.keeper = keeper = ReaderKeeper(name, secret, broker, reader_id)
        try:
            man = keeper.first_manifest(timeout_s)
            self.slots = man.slots
            self.state = SharedState.create(man.slots, 0, 0, man.rsegs, man.seg_bytes, named=True, read_only=True)
            self.remote = RemoteTier(self.state, int(io_timeout_s * 1000))
            keeper.state = self.state
            keeper.install(man)
            self.remote.load_index(range(0, -(-man.slots // SLOTS_PER_PAGE)))
            keeper.start(self.state)
        except BaseException:
            self.close()
            raise
        return self

    # --- the mapping API -------------------------------------------------------------------------

    def get(self, index: int, tier: str | None = None) -> np.ndarray | None:
        """The bytes stored for ``index`` (a new uint8 array the caller owns), or None.
        ``tier``: "local" or "remote" reads only that tier's copy (to measure one)."""
        st = self.state
        self._check_index(index)
        rec = st.read_slot(index)
        if self.read_only and (rec is None or not rec["length"] or not self._remote_current(rec)):
            self.remote.load_index([index // SLOTS_PER_PAGE])  # the owner may have stored it since
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
                st.count("lost" if lost_at(int(st.rlost[seg]), gen, int(st.rgen[seg])) else "stale")
            else:
                out = self.remote.read(seg, gen, int(rec["roff"]), n, crc)
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
        if rpos is not None and not self.remote.write(rpos[0], rpos[2], buf):
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
        if isinstance(self.keeper, OwnerKeeper):
            self.keeper.flush()

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
            replicas=self.replicas, processes=int(st.head[H["procs"]]),
            readers=dict(self.keeper.readers) if isinstance(self.keeper, OwnerKeeper) else {})
        if self.mem is not None:
            out["memory"] = dict(self.mem.stats)
        return out

    def close(self) -> None:
        """Give the donor memory back, withdraw the manifest, stop the threads.  In a forked worker
        this only drops the worker's own connections."""
        if os.getpid() != self._owner_pid:
            if self.remote is not None:
                self.remote.close()
            return
        if self._closed:
            return
        self._closed = True
        if self.keeper is not None:
            self.keeper.close()  # an owner's closes its RemoteMemory: every segment and the index go back
        elif self.mem is not None:
            self.mem.close()
        if self.remote is not None:
            self.remote.close()
        if self.state is not None:
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
            if tier == "r":  # recycled, not lost
                st.rlost[nxt] = int(st.rlost[nxt]) & ~(1 << (int(gen[nxt]) % 64)) & (2 ** 64 - 1)
            gen[nxt] = (int(gen[nxt]) + 1) & 0xFFFFFFFF
            st.count("evicted_segments")
        else:
            st.head[H[f"{tier}cur"]] = np.uint64(NONE)
            return None
        state[nxt] = FILLING
        fill[nxt] = need
        st.head[H[f"{tier}cur"]] = nxt
        return nxt, int(gen[nxt]), 0


__all__ = ["SampleCache", "MAX_ENTRY"]
