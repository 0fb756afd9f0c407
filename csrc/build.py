"""cffi out-of-line API-mode build of the dlshare C core.

Every component of csrc/ contributes three files and edits nothing shared:
``NAME.c`` (the code), ``NAME.h`` (its C declarations, included by the
generated module) and ``NAME.cdef`` (the subset of those declarations that
Python may call, in cffi's cdef syntax).  This script compiles all of them into
one extension, ``rdma._dlshare_c``.
"""

from __future__ import annotations

import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

ffibuilder = FFI()

_cdefs = sorted(HERE.glob("*.cdef"))
_headers = sorted(HERE.glob("*.h"))
_sources = sorted(HERE.glob("*.c"))

ffibuilder.cdef("\n".join(p.read_text() for p in _cdefs))
ffibuilder.set_source(
    "rdma._dlshare_c",
    "\n".join(f'#include "{h.name}"' for h in _headers),
    sources=[str(s.relative_to(HERE.parent)) for s in _sources],
    include_dirs=[str(HERE)],
    libraries=["pthread"],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function", "-fno-strict-aliasing"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
