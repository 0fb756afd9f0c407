"""Trained predictors kept beside the journal, so a restart after ``kill -9`` places again at once.

Training the predictors on the shared data takes seconds (about 9 s on the development VM) and gives
the same models every time (seeded); a restart loads the copy pickled at the first start instead.
The copy is keyed by the package and library versions and the data files' sizes and times, so a
change of any of them trains again.  It is written by this process into its own state directory
(mode 0600) and read back only from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("dlshare.slurm")


def data_key(files: list[Path], extra: str = "") -> str:
    """A key that changes when a file, the Python version or the libraries change."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"

    h = hashlib.sha256(f"{v('dlshare')}|{v('scikit-learn')}|{v('numpy')}|{sys.version}|{extra}".encode())
    for f in sorted(files):
        try:
            st = f.stat()
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
        except OSError:
            h.update(f"{f}|missing".encode())
    return h.hexdigest()


def cached(path: Path, key: str, build: Callable[[], Any]) -> Any:
    """The object pickled at ``path`` under ``key``; otherwise ``build()``, pickled there for next time."""
    try:
        with open(path, "rb") as f:
            stored = pickle.load(f)
        if isinstance(stored, dict) and stored.get("key") == key:
            return stored["value"]
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - a damaged cache is rebuilt, never fatal
        log.warning("slurm: ignoring the predictor cache %s: %s", path, exc)
    value = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            pickle.dump({"key": key, "value": value}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("slurm: cannot keep the trained predictors in %s: %s", path, exc)
    return value
