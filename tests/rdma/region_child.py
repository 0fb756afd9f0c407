"""Region scenarios that end a process (SIGBUS, SIGSEGV), run as ``python -m tests.rdma.region_child``.

Each prints what it observed, one line each, flushed, before the signal it expects:
``lost <broker|->``: every copy of the first extent goes; ``read`` must raise, a touch is SIGBUS.
``close <broker|->``: threads touch the region while the main thread closes it: each touch gives the
right bytes until the close, and then SIGSEGV (never other bytes, never a hang).
``close-busy <broker|->``: a close while units are being written back; nothing touches the region
after it, so the process lives on.
With a broker URL the copies are on real donors (the parent kills them when the child says
``ready``, then writes a line to the child's stdin); with ``-`` on slab servers in this process.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

from rdma.buffer import DataLostError

UNIT = 64 << 10


def say(*parts) -> None:
    print(*parts, flush=True)


def open_region(broker: str, nbytes: int, local: int, unit: int = UNIT):
    if broker == "-":
        from tests.rdma.regions import LocalCluster

        cluster = LocalCluster(2)
        region, _ = cluster.region(nbytes, local, unit=unit, replicas=2)
        return region, cluster
    from nodesvc.bus.procs import wait_until
    from rdma import RemoteMemory

    mem = RemoteMemory(broker, replicas=2, seed=11)
    wait_until(lambda: len(mem.donors()) >= 2, 20, "donors")
    return mem.map(nbytes, local_bytes=local, unit=unit), mem


def copies_of(region, index: int) -> list[dict]:
    """The engine's copy map of an extent, each copy named by its donor (from the buffer's replicas)."""
    names = {(r.addr, r.slab): r.node for e in region.buffer.extents for r in e.replicas}
    return [{**c, "node": names.get((c["addr"], c["slab"]), c["addr"])} for c in region.engine_copies(index)]


def lost(broker: str) -> None:
    region, owner = open_region(broker, 4 << 20, 16 * UNIT)
    a = region.array(np.uint32)
    data = np.arange(len(a), dtype=np.uint32) + 0x5A5A0000  # never zeros: a silent-zeros read cannot pass
    per = UNIT // 4
    for i in range(0, len(a), per):  # unit by unit, first to last, whichever way memmove runs
        a[i:i + per] = data[i:i + per]
    region.flush()
    region.prefetch(2 << 20, 2 << 20)  # the second half in: the first is written back and evicted
    say("state", region.unit_state(0))
    # the copies the engine itself would read unit 0 from, which must be the ones RemoteMemory placed
    engine = copies_of(region, 0)
    placed = sorted(r.node for r in region.buffer.extents[0].replicas)
    say("copies", json.dumps({"engine": engine, "placed": placed}))
    say("ready", json.dumps(sorted({c["node"] for c in engine})))
    if broker == "-":
        for s in owner.servers:
            s.stop()
    else:
        sys.stdin.readline()  # the parent stopped, then killed, every donor of the engine's copies
    say("state before read", region.unit_state(0))
    try:
        got = region.read(0, 4096)
        say("read returned", int(got.view(np.uint32)[0]), "from", json.dumps(copies_of(region, 0)),
            json.dumps(region.placement()[0]))
    except DataLostError as exc:
        say("read raised DataLostError", exc)
    say("touching")
    value = int(a[0])  # SIGBUS here
    say("touch returned", value)


def close(broker: str) -> None:
    region, _ = open_region(broker, 4 << 20, 16 * UNIT)
    a = region.array(np.uint64)
    a[:] = np.arange(len(a), dtype=np.uint64)
    ops = [0, 0]
    wrong: list[str] = []

    def touch(k: int) -> None:
        rng = np.random.default_rng(k)
        while True:
            i = int(rng.integers(0, len(a) - 4096))
            got = a[i:i + 4096].copy()  # large enough to run without the GIL
            if not np.array_equal(got, np.arange(i, i + 4096, dtype=np.uint64)):
                wrong.append(f"thread {k} read wrong bytes at {i}")
                say("WRONG", wrong[-1])
            ops[k] += 1

    for k in range(2):
        threading.Thread(target=touch, args=(k,), daemon=True).start()
    while min(ops) < 50:
        time.sleep(0.01)
    say("closing after", ops)
    region.close()
    say("closed")
    time.sleep(10)  # the threads touch the closed range: SIGSEGV before this ends
    say("survived", ops)


def close_busy(broker: str) -> None:
    """Close right after a large write: the engine is still writing units back.  Nothing touches the
    region after close, so the process must live on."""
    region, _ = open_region(broker, 16 << 20, 2 << 20, unit=4096)  # small units: many write-backs in flight
    region.array(np.uint8)[:] = 7
    region.close()
    say("closed")
    time.sleep(0.5)
    say("survived")


if __name__ == "__main__":
    {"lost": lost, "close": close, "close-busy": close_busy}[sys.argv[1]](sys.argv[2])
