"""dlshare remote memory: the Python face of csrc/.

Public names are re-exported here on purpose; everything else is private.
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
