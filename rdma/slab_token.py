"""A slab's access token: 16 random bytes that every request on the slab must carry."""

from __future__ import annotations

from rdma.native import ffi, lib

TOKEN_BYTES = 16


def random_token() -> bytes:
    """16 bytes from the kernel CSPRNG (getrandom)."""
    out = ffi.new("uint8_t[16]")
    rc = lib.dls_random_token(out)
    if rc:
        raise OSError(-rc, "getrandom failed")
    return bytes(ffi.buffer(out, 16))
