"""cffi out-of-line API-mode build of the dlshare C core.

Every component of csrc/ is ``NAME.c`` (the code) and ``NAME.h`` (its C
declarations), and edits nothing shared.  A component that Python calls also
has ``NAME.cdef`` (the subset of its declarations that Python may call, in
cffi's cdef syntax); its header is included by the generated module.  A
component without a ``.cdef`` is internal: other C files use it, Python never
sees it (slab_service, the request side of tcp_server).  This script compiles
every ``.c`` into one extension, ``rdma._dlshare_c``.
"""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent

# -Werror: a warning is a bug to fix, in our sources and in the module cffi generates.
CFLAGS = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fno-strict-aliasing"]
# DLSHARE_SANITIZE=1 (make sanitize): AddressSanitizer and UndefinedBehaviorSanitizer, every finding fatal.
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
_sanitize = os.environ.get("DLSHARE_SANITIZE") == "1"

ffibuilder = FFI()

_cdefs = sorted(HERE.glob("*.cdef"))
_headers = [HERE / f"{p.stem}.h" for p in _cdefs]  # the Python-facing components only
_sources = sorted(HERE.glob("*.c"))

ffibuilder.cdef("\n".join(p.read_text() for p in _cdefs))
ffibuilder.set_source(
    "rdma._dlshare_c",
    "\n".join(f'#include "{h.name}"' for h in _headers),
    sources=[str(s.relative_to(HERE.parent)) for s in _sources],
    # every header: editing one rebuilds the extension
    depends=[str(h.relative_to(HERE.parent)) for h in sorted(HERE.glob("*.h"))],
    include_dirs=[str(HERE)],
    libraries=["pthread"],
    extra_compile_args=(["-O1", "-g", *SANITIZE] if _sanitize else ["-O3"]) + CFLAGS,
    extra_link_args=SANITIZE if _sanitize else [],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
