"""The Python handles on the C data plane, by their old names, for callers that import them from here.

Each concept has its own module: :mod:`rdma.errors` (RemoteMemoryError), :mod:`rdma.slab_token`
(random_token), :mod:`rdma.slab_memory` (SlabMemory, a donor's slab memory, once called ``Region``
here), :mod:`rdma.slab_server` (SlabServer), :mod:`rdma.endpoint` (Endpoint) and :mod:`rdma.clock`
(monotonic_ns).  New code imports from those.
"""

from __future__ import annotations

from rdma.clock import monotonic_ns
from rdma.endpoint import LOCAL_CRC, Endpoint, provider_available
from rdma.errors import RemoteMemoryError
from rdma.native import ffi, lib
from rdma.slab_memory import HUGE as REGION_HUGE
from rdma.slab_memory import LOCK as REGION_LOCK
from rdma.slab_memory import POPULATE as REGION_POPULATE
from rdma.slab_memory import SlabMemory
from rdma.slab_server import MAX_TIMEOUT_S, SlabServer, SlabStats
from rdma.slab_token import random_token

Region = SlabMemory  # the old name of a donor's slab memory

__all__ = ["LOCAL_CRC", "MAX_TIMEOUT_S", "REGION_HUGE", "REGION_LOCK", "REGION_POPULATE", "Endpoint", "Region",
           "RemoteMemoryError", "SlabMemory", "SlabServer", "SlabStats", "ffi", "lib", "monotonic_ns",
           "provider_available", "random_token"]
