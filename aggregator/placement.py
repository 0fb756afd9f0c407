"""Where each chunk of a job's tensors goes: even splits, striping, consistent-hash fallback (pure).

A key (a tensor, a DDP bucket) is cut into chunks of equal size, as many as
``chunk_bytes`` asks for, rounded up to a multiple of the number of servers
(never below ``MIN_SPLIT_BYTES`` a chunk), so every server gets the same
bytes of every large key.  Chunk ``c`` of key ``k`` goes to server
``(h(job) + k + c) mod n`` of the sorted server list: with all servers up the
load is even, which hashing alone would not give with a few dozen chunks
(the busiest of 4 servers would carry about 1.5x the mean, and a round is as
slow as its busiest server).

A chunk whose server is down or draining for that round falls back to a
consistent-hash ring over the others, so losing a server moves only its own
chunks and every other chunk stays put.  Every rank of a job computes the
same placement from the same server list; nothing here reads a clock or draws
randomness.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

VNODES = 64  # virtual nodes per server on the fallback ring: spreads moved chunks evenly over few servers
MIN_SPLIT_BYTES = 64 << 10  # splitting finer than this for balance costs more in headers than it saves
# A chunk should take about this long on its connection's share of the link.  A step's pipeline
# fills and drains once (its first results wait for a whole chunk from every rank, its last follow
# the last chunk), and the push window (aggregator/link.py) lets ranks drift apart by a few chunks,
# so smaller is faster until the per-chunk cost shows: 15-25 us of CPU per message at each end
# beyond the per-byte copies (loopback, 2-vCPU VM), and on a machine that also computes the
# gradients that CPU slows the backward pass.  Sweep at 500 Mbit/s, k = n = 4, window 4 chunks
# (bench/RESULTS.md, issue 28): 128 KiB chunks (8.4 ms) stepped at 1.19x the bound, 256 KiB
# (17 ms) at 1.22-1.25x, 1 MiB at 1.28-1.37x.
CHUNK_TIME_S = 0.008
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64 << 10, 4 << 20


class NoServer(LookupError):
    """Every server is down or draining for the round asked about."""


def h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class HashRing:
    """Consistent hashing of items onto servers, skipping the ones in ``skip``."""

    def __init__(self, servers: Iterable[str]) -> None:
        self.servers = sorted(dict.fromkeys(servers))
        if not self.servers:
            raise ValueError("need at least one aggregation server")
        pts = sorted((h64(f"{s}#{i}"), s) for s in self.servers for i in range(VNODES))
        self._hashes = [p[0] for p in pts]
        self._owners = [p[1] for p in pts]

    def route(self, item: str, skip: Iterable[str] = frozenset()) -> str:
        skip = set(skip)
        if skip.issuperset(self.servers):
            raise NoServer(f"every aggregation server ({', '.join(self.servers)}) is down or draining")
        i = bisect.bisect(self._hashes, h64(item)) % len(self._hashes)
        while self._owners[i] in skip:
            i = (i + 1) % len(self._hashes)
        return self._owners[i]


def chunk_for_link(link_bytes_per_s: float, servers: int, world: int) -> int:
    """The chunk size for hosts whose links carry ``link_bytes_per_s`` each way (the same on every rank).

    A rank's link is shared by its connections to the ``servers``, and a server's by the ``world``
    ranks pushing to it, so each connection gets ``link / max(servers, world)``; a chunk is that
    share times :data:`CHUNK_TIME_S`, in whole 4 KiB pages, between 64 KiB and 4 MiB."""
    if link_bytes_per_s <= 0:
        raise ValueError("the link rate must be positive")
    share = link_bytes_per_s / max(1, servers, world)
    want = int(share * CHUNK_TIME_S) // 4096 * 4096
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, want))


def split(numel: int, itemsize: int, chunk_bytes: int, servers: int) -> list[tuple[int, int]]:
    """``(first element, elements)`` of each chunk of a key of ``numel`` elements."""
    if numel <= 0:
        return []
    nbytes = numel * itemsize
    want = -(-nbytes // chunk_bytes)
    if servers > 1:
        balanced = -(-want // servers) * servers
        want = max(want, min(balanced, nbytes // MIN_SPLIT_BYTES))
    per = -(-numel // want)
    # chunk_bytes is a multiple of 4, so per * itemsize <= chunk_bytes whatever the dtype
    return [(o, min(per, numel - o)) for o in range(0, numel, per)]


class Placement:
    """The servers of one job and the rule that places its chunks on them."""

    def __init__(self, servers: Iterable[str], job: str) -> None:
        self.ring = HashRing(servers)
        self.servers = self.ring.servers
        self.job = job
        # Keys are striped too (DDP numbers its buckets 0, 1, 2, ...), so one-chunk keys spread evenly;
        # the job's hash picks where the stripe starts, so jobs do not all start on the same server.
        self._base = h64(job)

    def primary(self, key: int, chunk: int) -> str:
        return self.servers[(self._base + key + chunk) % len(self.servers)]

    def server_for(self, key: int, chunk: int, skip: Iterable[str] = frozenset()) -> str:
        """The server of chunk ``chunk`` of key ``key`` when the servers in ``skip`` cannot take it."""
        p = self.primary(key, chunk)
        skip = set(skip)
        if p not in skip:
            return p
        return self.ring.route(f"{self.job}/{key}/{chunk}", skip)
