"""dlshare remote memory: the Python face of csrc/.

    from rdma import RemoteMemory, SpillCache

    with RemoteMemory(broker="mqtt://127.0.0.1:1883", replicas=2) as mem:
        buf = mem.alloc(1 << 30)              # slabs on 2 donors per extent
        buf.write(0, array)                   # to every copy
        out = buf.read(4096, 4096)            # from one live copy, page CRCs checked
        pages = buf.read_pages([7, 3, 900])   # batched gather, pipelined in C
        cache = SpillCache(4 << 30, remote=mem)  # key -> bytes, LRU locally, spills to mem
        with mem.map(8 << 30, local_bytes=2 << 30) as region:  # pages on donors, 2 GiB resident
            table = region.array(np.float32, (rows, 64))        # plain numpy, no copy
            emb = region.tensor(torch.float32, (rows, 64))      # or a CPU torch tensor

    region = region_from_env()  # in a job started by a node daemon with remote_memory_bytes
    train = CachedDataset(dataset)  # its samples cached locally and on donors, shared by DataLoader workers

Donors are node daemons started with ``lend = true`` (nodesvc/daemon/donor.py).

What this package may import (floor 1 of the floor plan; README, Development):
its own C extension (``rdma._dlshare_c``, built from csrc/), numpy, the standard
library, and the control-plane substrate ``nodesvc.bus`` (MQTT bus, codec, the
command/reply correlator).  Never a shell (``nodesvc.daemon``, a server, a CLI)
nor ``bench``; the donor side (nodesvc.daemon.donor) imports rdma, not the reverse.

Inside, each module imports only modules listed before it: native, wire,
placement and replica (none imports another); errors, slab_token, clock and slab_memory
(the C data plane's handles, one concept each); slab_server; endpoint; native_mem
(their old names, for callers that import them from there); buffer (which
declares the ReplicaIO it needs); dataplane (which provides it); control;
region (the mapping and its C engine); remote; spill; sample_codec, cache_manifest,
cache_state and cache_bus (none imports another); cache_remote; cache_keeper; sample_cache; env
(region_from_env, sample_cache_from_env);
dataset (CachedDataset); torch (the PyTorch helper, which imports torch only when called).
``lint-imports`` fails on a circle.

The names below are the public surface, re-exported here on purpose; every other
module and name is the package's own business and may change.
"""

from rdma.native import crc32c

__all__ = ["crc32c", "RemoteMemory", "RemoteBuffer", "RemoteMemoryError", "DataLostError", "ReplicaState",
           "SpillCache", "RemoteRegion", "region_from_env", "spill_cache_from_env", "place_embeddings",
           "place_tensors", "prefetch_lookups", "SampleCache", "CachedDataset", "sample_cache_from_env"]

# Imported on first use: the consumer side pulls in the MQTT stack, which the donor side
# and the C-only tools (aggregator kernels, crc32c) do not need.  Plain imports (not names in
# strings), so that the import graph, and lint-imports, see them.
def _consumer_side() -> dict[str, object]:
    from rdma.buffer import DataLostError, RemoteBuffer
    from rdma.dataset import CachedDataset
    from rdma.env import region_from_env, sample_cache_from_env, spill_cache_from_env
    from rdma.errors import RemoteMemoryError
    from rdma.region import RemoteRegion
    from rdma.remote import RemoteMemory
    from rdma.replica import ReplicaState
    from rdma.sample_cache import SampleCache
    from rdma.spill import SpillCache
    from rdma.torch import place_embeddings, place_tensors, prefetch_lookups

    return dict(locals())


def __getattr__(name: str):
    if name not in __all__ or name in globals():
        raise AttributeError(f"module 'rdma' has no attribute {name!r}")
    globals().update(_consumer_side())  # once is enough
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
