"""dlshare remote memory: the Python face of csrc/.

    from rdma import RemoteMemory, SpillCache

    with RemoteMemory(broker="mqtt://127.0.0.1:1883", replicas=2) as mem:
        buf = mem.alloc(1 << 30)              # slabs on 2 donors per extent
        buf.write(0, array)                   # to every copy
        out = buf.read(4096, 4096)            # from one live copy, page CRCs checked
        pages = buf.read_pages([7, 3, 900])   # batched gather, pipelined in C
        cache = SpillCache(4 << 30, remote=mem)  # key -> bytes, LRU locally, spills to mem

Donors are node daemons started with ``lend = true`` (nodesvc/donor.py).  Public
names are re-exported here on purpose; everything else is private.
"""

from rdma.native import crc32c

__all__ = ["crc32c", "RemoteMemory", "RemoteBuffer", "RemoteMemoryError", "DataLostError", "SpillCache"]


def __getattr__(name: str):
    # imported lazily: the consumer pulls in the MQTT stack, which the donor side and
    # the C-only tools do not need
    if name == "RemoteMemory":
        from rdma.remote import RemoteMemory
        return RemoteMemory
    if name in ("RemoteBuffer", "DataLostError"):
        from rdma import buffer
        return getattr(buffer, name)
    if name == "RemoteMemoryError":
        from rdma.native_mem import RemoteMemoryError
        return RemoteMemoryError
    if name == "SpillCache":
        from rdma.spill import SpillCache
        return SpillCache
    raise AttributeError(f"module 'rdma' has no attribute {name!r}")
