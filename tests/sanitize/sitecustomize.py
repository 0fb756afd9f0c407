"""`make sanitize`: every Python process of the run (pytest and the processes it starts) loads the C
core built with AddressSanitizer and UndefinedBehaviorSanitizer instead of the in-place build.

The Makefile puts this directory on PYTHONPATH and names the sanitized extension in
DLSHARE_SANITIZED_EXT; it is loaded here as ``rdma._dlshare_c`` before anything imports rdma, so
``from rdma._dlshare_c import ffi, lib`` finds it.  A name that does not load stops the process:
a run that silently tested the ordinary build would prove nothing.
"""

import importlib.util
import os
import sys

_path = os.environ.get("DLSHARE_SANITIZED_EXT")
if _path:
    _spec = importlib.util.spec_from_file_location("rdma._dlshare_c", _path)
    if _spec is None or _spec.loader is None:
        sys.exit(f"sanitize: cannot load {_path}")
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    sys.modules["rdma._dlshare_c"] = _mod
