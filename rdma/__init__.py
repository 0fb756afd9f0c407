"""dlshare remote memory: the Python face of csrc/.

Public names are re-exported here on purpose; everything else is private.
"""

from rdma.native import crc32c

__all__ = ["crc32c"]
