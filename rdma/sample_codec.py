"""Samples as bytes and back, for the sample cache: tensors, arrays, images, numbers, text, and
tuples, lists and dicts of them.  Pure: no I/O.

Why not pickle: a named cache is read by other jobs (rdma.sample_cache), and unpickling bytes
another job wrote runs whatever code that job chose.  This format can only build data.

A sample is ``MAGIC`` then one value; a value is a tag byte and its body (little-endian):

====  ==========================================================================
tag   body
====  ==========================================================================
N     None
B     bool: one byte, 0 or 1
i     int: int64 (numpy integer scalars too: they come back as int, likewise floats and bools)
f     float: float64
s     str: u32 length, UTF-8 bytes
y     bytes: u32 length, the bytes
t l   tuple, list: u32 count, the values
d     dict: u32 count, then (str key value, value) pairs; keys are str
a     numpy array: dtype (u8 length, numpy's ``dtype.str``), u8 ndim, u64 dims, the C-order data
T     torch tensor: torch dtype name (u8 length, e.g. ``float32``), then as an array of its bytes' view
P     PIL image: mode (u8 length, ASCII), then an array (what ``numpy.asarray(image)`` gives)
====  ==========================================================================

:func:`decode` rebuilds arrays and tensors as views of the buffer it is given (no copy), so
give it a buffer the sample may keep (the cache reads each entry into a fresh one).  Every
length is checked against the buffer, and depth and counts are bounded: a bad buffer raises
:class:`SampleFormatError`, never anything else.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

MAGIC = b"DLS\x01"
MAX_DEPTH = 32
MAX_ITEMS = 1 << 20  # items of one container
MAX_NDIM = 32
MAX_DIM = 1 << 40  # one dimension (a zero-size array may name huge ones)

# numpy dtypes a sample may hold (no object dtype: it would be pointers)
_KINDS = set("biufc")
# torch dtypes by name -> (numpy dtype the bytes are carried as, needs a view back)
_TORCH = {
    "float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2", "int8": "|i1", "uint8": "|u1",
    "int16": "<i2", "int32": "<i4", "int64": "<i8", "bool": "|b1", "complex64": "<c8", "complex128": "<c16",
    "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
}


class SampleFormatError(ValueError):
    """Bytes that are not a sample of this format (or a sample that cannot be written in it)."""


# --- encoding --------------------------------------------------------------------------------------------

def encode(value: Any) -> bytes:
    """One sample as bytes (raises :class:`SampleFormatError` for a type the format has no tag for)."""
    parts: list[bytes | memoryview] = [MAGIC]
    _enc(value, parts, 0)
    return b"".join(parts)


def _short(text: str) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > 255:
        raise SampleFormatError("name too long")
    return bytes([len(raw)]) + raw


def _enc_array(a: np.ndarray, parts: list, tag: bytes) -> None:
    if a.dtype.kind not in _KINDS or a.dtype.hasobject:
        raise SampleFormatError(f"arrays of dtype {a.dtype} cannot be cached")
    if a.ndim > MAX_NDIM:
        raise SampleFormatError(f"arrays of {a.ndim} dimensions cannot be cached")
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    a = a.astype(dt, order="C", copy=False)  # (np.ascontiguousarray would make a 0-d array 1-d)
    parts.append(tag + _short(dt.str) + bytes([a.ndim]) + struct.pack(f"<{a.ndim}Q", *a.shape))
    parts.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")


def _enc(v: Any, parts: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise SampleFormatError(f"a sample nested deeper than {MAX_DEPTH}")
    if v is None:
        parts.append(b"N")
    elif isinstance(v, (bool, np.bool_)):
        parts.append(b"B" + (b"\x01" if v else b"\x00"))
    elif isinstance(v, (int, np.integer)):
        if not -(1 << 63) <= int(v) < (1 << 63):
            raise SampleFormatError(f"integer {v} does not fit in 64 bits")
        parts.append(b"i" + struct.pack("<q", int(v)))
    elif isinstance(v, (float, np.floating)):
        parts.append(b"f" + struct.pack("<d", float(v)))
    elif isinstance(v, str):
        raw = v.encode("utf-8")
        parts.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        raw = bytes(v)
        parts.append(b"y" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(v, (tuple, list)):
        if len(v) > MAX_ITEMS:
            raise SampleFormatError(f"a container of {len(v)} items")
        parts.append((b"t" if isinstance(v, tuple) else b"l") + struct.pack("<I", len(v)))
        for x in v:
            _enc(x, parts, depth + 1)
    elif isinstance(v, dict):
        if len(v) > MAX_ITEMS:
            raise SampleFormatError(f"a dict of {len(v)} items")
        parts.append(b"d" + struct.pack("<I", len(v)))
        for k, x in v.items():
            if not isinstance(k, str):
                raise SampleFormatError(f"dict keys must be str to be cached, got {type(k).__name__}")
            _enc(k, parts, depth + 1)
            _enc(x, parts, depth + 1)
    elif isinstance(v, np.ndarray):
        _enc_array(v, parts, b"a")
    elif type(v).__module__.startswith("torch") and hasattr(v, "numpy") and hasattr(v, "dtype"):
        t = v.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH:
            raise SampleFormatError(f"tensors of dtype {t.dtype} cannot be cached")
        import torch

        raw = t.view(torch.uint16) if name == "bfloat16" else t
        parts.append(b"T" + _short(name))
        _enc_array(raw.numpy(), parts, b"")
    elif type(v).__module__.startswith("PIL") and hasattr(v, "mode") and hasattr(v, "size"):
        parts.append(b"P" + _short(v.mode))
        _enc_array(np.asarray(v), parts, b"")
    else:
        raise SampleFormatError(f"{type(v).__name__} cannot be cached: use tensors, arrays, PIL images, "
                                "numbers, str, bytes, and tuples, lists and dicts of them")


# --- decoding --------------------------------------------------------------------------------------------

class _Reader:
    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise SampleFormatError(f"truncated: {n} bytes wanted at {self.pos} of {self.end}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def name(self) -> str:
        raw = bytes(self.take(self.u8()))
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise SampleFormatError("a name that is not ASCII") from None


def decode(data) -> Any:
    """The sample in ``data`` (bytes-like).  Arrays and tensors are views of ``data`` where its
    alignment allows (else copies)."""
    buf = memoryview(data).cast("B")
    if bytes(buf[:4]) != MAGIC:
        raise SampleFormatError("not a cached sample (bad magic)")
    r = _Reader(buf)
    r.pos = 4
    try:
        v = _dec(r, 0)
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        raise SampleFormatError(f"bad sample: {exc}") from None
    if r.pos != r.end:
        raise SampleFormatError(f"{r.end - r.pos} stray bytes after the sample")
    return v


def _dec_array(r: _Reader) -> np.ndarray:
    dts = r.name()
    try:
        dt = np.dtype(dts)
    except TypeError:
        raise SampleFormatError(f"unknown dtype {dts!r}") from None
    if dt.kind not in _KINDS or dt.hasobject or dt.str != dts or dt.itemsize == 0:
        raise SampleFormatError(f"dtype {dts!r} is not allowed")
    ndim = r.u8()
    if ndim > MAX_NDIM:
        raise SampleFormatError(f"{ndim} dimensions")
    shape = r.unpack(f"<{ndim}Q") if ndim else ()
    if any(d > MAX_DIM for d in shape):
        raise SampleFormatError(f"an array of shape {shape}")
    count = 1
    for d in shape:
        count *= d
    if count * dt.itemsize > r.end - r.pos:
        raise SampleFormatError(f"an array of shape {shape} does not fit in the buffer")
    raw = r.take(count * dt.itemsize)
    try:
        if count and (np.frombuffer(raw, np.uint8).ctypes.data % dt.alignment == 0):
            return np.frombuffer(raw, dtype=dt).reshape(shape)
        return np.frombuffer(bytes(raw), dtype=dt).reshape(shape) if count else np.empty(shape, dt)
    except ValueError as exc:  # a zero-size shape numpy will not make
        raise SampleFormatError(f"an array of shape {shape}: {exc}") from None


def _dec(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise SampleFormatError(f"nested deeper than {MAX_DEPTH}")
    tag = r.u8()
    if tag == ord("N"):
        return None
    if tag == ord("B"):
        b = r.u8()
        if b > 1:
            raise SampleFormatError(f"bool byte {b}")
        return bool(b)
    if tag == ord("i"):
        return r.unpack("<q")[0]
    if tag == ord("f"):
        return r.unpack("<d")[0]
    if tag == ord("s"):
        (n,) = r.unpack("<I")
        return bytes(r.take(n)).decode("utf-8")
    if tag == ord("y"):
        (n,) = r.unpack("<I")
        return bytes(r.take(n))
    if tag in (ord("t"), ord("l")):
        (n,) = r.unpack("<I")
        if n > MAX_ITEMS or n > r.end - r.pos:
            raise SampleFormatError(f"a container of {n} items")
        items = [_dec(r, depth + 1) for _ in range(n)]
        return tuple(items) if tag == ord("t") else items
    if tag == ord("d"):
        (n,) = r.unpack("<I")
        if n > MAX_ITEMS or 2 * n > r.end - r.pos:
            raise SampleFormatError(f"a dict of {n} items")
        out = {}
        for _ in range(n):
            k = _dec(r, depth + 1)
            if not isinstance(k, str):
                raise SampleFormatError("a dict key that is not str")
            out[k] = _dec(r, depth + 1)
        return out
    if tag == ord("a"):
        return _dec_array(r)
    if tag == ord("T"):
        name = r.name()
        if name not in _TORCH:
            raise SampleFormatError(f"torch dtype {name!r} is not allowed")
        a = _dec_array(r)
        if a.dtype.str != _TORCH[name]:
            raise SampleFormatError(f"a {name} tensor carried as {a.dtype.str}")
        import torch
        import warnings

        with warnings.catch_warnings():  # a read-only buffer (bytes): the sample is the reader's
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(a) if a.size else torch.from_numpy(a.copy())
        return t.view(torch.bfloat16) if name == "bfloat16" else t
    if tag == ord("P"):
        mode = r.name()
        a = _dec_array(r)
        from PIL import Image

        try:
            img = Image.fromarray(a)
            return img if img.mode == mode else img.convert(mode)
        except (ValueError, TypeError, KeyError) as exc:
            raise SampleFormatError(f"an image of mode {mode!r} and shape {a.shape}: {exc}") from None
    raise SampleFormatError(f"unknown tag {tag!r}")


__all__ = ["encode", "decode", "SampleFormatError", "MAGIC"]
