"""The cffi binding of csrc/ (``rdma._dlshare_c``) and thin Python wrappers.

The extension is built by ``pip install -e .`` (or ``make ext``).  Everything
that touches C goes through ``ffi`` and ``lib`` from here.
"""

from __future__ import annotations

try:
    from rdma._dlshare_c import ffi, lib  # type: ignore[import-not-found]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "the dlshare C extension is not built; run `make ext` "
        "(or `pip install -e .`) in the project root"
    ) from exc

__all__ = ["ffi", "lib", "crc32c", "crc32c_uses_sse42"]


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of a bytes-like object (bytes, bytearray, memoryview, numpy array).

    Pass a previous result as ``crc`` to continue over the next buffer.
    """
    buf = ffi.from_buffer(data)
    return int(lib.dls_crc32c(crc & 0xFFFFFFFF, buf, len(buf)))


def crc32c_table(data, crc: int = 0) -> int:
    """The table-driven implementation, always (for tests and comparison)."""
    buf = ffi.from_buffer(data)
    return int(lib.dls_crc32c_sw(crc & 0xFFFFFFFF, buf, len(buf)))


def crc32c_uses_sse42() -> bool:
    return bool(lib.dls_crc32c_hw())
