"""The C reduction kernels (csrc/reduce.c) on numpy buffers.

Calls go through cffi's API mode, which releases the GIL, so several pool
threads sum at once.  Buffers are raw bytes interpreted by ``dtype`` (a
:class:`aggregator.protocol.DType`), which is how bf16 travels: as uint16 bits.
"""

from __future__ import annotations

from collections.abc import Sequence

from aggregator.protocol import DType
from rdma.native import ffi, lib

__all__ = ["reduce_sum", "add_", "scale_", "convert", "uses_simd", "force_scalar"]


def _count(buf, dtype: DType) -> int:
    n = memoryview(buf).nbytes
    if n % dtype.itemsize:
        raise ValueError(f"buffer of {n} bytes is not a whole number of {dtype.name} elements")
    return n // dtype.itemsize


def reduce_sum(dtype: DType, dst, srcs: Sequence, divisor: float = 1.0) -> None:
    """``dst = (srcs[0] + srcs[1] + ...) / divisor``, summed in the given order in fp32.

    ``dst`` may be ``srcs[0]``.  All buffers must hold the same number of bytes.
    """
    if not srcs:
        raise ValueError("reduce_sum needs at least one source")
    count = _count(dst, dtype)
    keep = [ffi.from_buffer(s) for s in srcs]
    for s, k in zip(srcs, keep):
        if len(k) != count * dtype.itemsize:
            raise ValueError(f"source of {len(k)} bytes does not match destination of {count * dtype.itemsize}")
    ptrs = ffi.new("const void *[]", keep)
    out = ffi.from_buffer(dst, require_writable=True)
    if lib.dls_reduce_sum(int(dtype), out, ptrs, len(keep), count, float(divisor)) != 0:
        raise ValueError(f"reduce_sum rejected dtype {dtype!r} or divisor {divisor}")


def add_(dtype: DType, dst, src) -> None:
    """``dst += src`` in place."""
    count = _count(dst, dtype)
    s = ffi.from_buffer(src)
    if len(s) != count * dtype.itemsize:
        raise ValueError("add_: buffers differ in size")
    if lib.dls_reduce_add(int(dtype), ffi.from_buffer(dst, require_writable=True), s, count) != 0:
        raise ValueError(f"add_ rejected dtype {dtype!r}")


def scale_(dtype: DType, dst, divisor: float) -> None:
    """``dst /= divisor`` in place."""
    count = _count(dst, dtype)
    if lib.dls_reduce_scale(int(dtype), ffi.from_buffer(dst, require_writable=True), count, float(divisor)) != 0:
        raise ValueError(f"scale_ rejected dtype {dtype!r} or divisor {divisor}")


def convert(dst_dtype: DType, dst, src_dtype: DType, src) -> None:
    """``dst = src`` in ``dst_dtype`` (fp32 to fp16/bf16 rounds to nearest even; widening is exact)."""
    count = _count(src, src_dtype)
    d = ffi.from_buffer(dst, require_writable=True)
    if len(d) != count * dst_dtype.itemsize:
        raise ValueError(f"convert: {len(d)}-byte destination for {count} {dst_dtype.name} elements")
    if lib.dls_reduce_convert(int(dst_dtype), d, int(src_dtype), ffi.from_buffer(src), count) != 0:
        raise ValueError(f"convert rejected {dst_dtype!r} or {src_dtype!r}")


def uses_simd() -> bool:
    return bool(lib.dls_reduce_simd())


def force_scalar(on: bool) -> None:
    """Tests and benchmarks: pin the scalar path (True) or restore run-time dispatch."""
    lib.dls_reduce_force_scalar(1 if on else 0)
