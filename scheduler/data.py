"""The shared data directory: where it is, and loaders for each file.

Resolution order: ``$DLSHARE_DATA``; else ``../shared/data`` beside the
checkout; else the user cache (``$XDG_CACHE_HOME/dlshare/data``) that
``dlshare data fetch`` fills (:mod:`scheduler.fetch`).  Files are never
committed to the project.  The loaders cache their result per path.  A file
that is not what it should be (not UTF-8, not JSON, a cell that is not a finite
number within its bound) is a :class:`DataFormatError` naming the file and row.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

FILES = (
    "philly/vc_0e4a51.csv", "philly/vc_103959.csv", "philly/runtimes.csv", "gavel/throughputs.json",
    "iadeep/colocation_util.csv", "iadeep/offline_info.csv", "synergy/sensitivity.json",
    "synergy/static_100job.csv", "lucid/colocation.csv", "lucid/solo.csv",
)


MAX_DATA_BYTES = 256 << 20  # the largest shared file is a few MB
MAX_RUNTIME_S = 1e9         # philly/runtimes.csv tops out at 4.6e6 s; 31 years is garbage


class DataError(FileNotFoundError):
    """A data file is missing; the message says where it looked and how to fetch it."""


class DataFormatError(ValueError):
    """A data file that cannot be used as what it should be; the message names the file and row."""


def read_capped(p: str | os.PathLike[str], limit: int, error: type[Exception] = ValueError,
                where: str | None = None) -> bytes:
    """At most ``limit`` bytes of a file (``-``: standard input), for every reader of files an operator
    hands in: ``error`` naming ``where`` (default: the path) when it cannot be read or is larger, so
    that ``/dev/zero`` or a directory is one clear error, never a hang or a traceback."""
    where = str(p) if where is None else where
    try:
        if str(p) == "-":
            raw = sys.stdin.buffer.read(limit + 1)
        else:
            with open(p, "rb") as fh:
                raw = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{where}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise error(f"{where}: larger than {size}")
    return raw


def read_text(p: str | os.PathLike[str]) -> str:
    """A data file as text: UTF-8 (a byte-order mark dropped), at most MAX_DATA_BYTES."""
    raw = read_capped(p, MAX_DATA_BYTES, DataFormatError)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        row = raw.count(b"\n", 0, exc.start) + 1
        raise DataFormatError(f"{p}: row {row}: not UTF-8 text") from None


def _number(text: str, p: Any, row: int, column: str, bound: float = math.inf) -> float:
    try:
        v = float(text)
    except ValueError:
        raise DataFormatError(f"{p}: row {row}: column {column}: not a number: {text[:40]!r}") from None
    if not (math.isfinite(v) and abs(v) <= bound):
        raise DataFormatError(f"{p}: row {row}: column {column}: {text[:40]!r} is not a finite number"
                              + (f" within +-{bound:g}" if bound < math.inf else ""))
    return v


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlshare" / "data"


def candidates() -> list[Path]:
    out = []
    if os.environ.get("DLSHARE_DATA"):
        out.append(Path(os.environ["DLSHARE_DATA"]))
    checkout = Path(__file__).resolve().parent.parent
    out.append(checkout.parent / "shared" / "data")
    out.append(cache_dir())
    return out


def data_dir() -> Path:
    """The first candidate directory that exists (see the module docstring)."""
    for d in candidates():
        if d.is_dir():
            return d
    raise DataError("no data directory: set $DLSHARE_DATA, or run `dlshare data fetch` "
                    f"(looked in {', '.join(map(str, candidates()))})")


def path(rel: str) -> Path:
    """Absolute path of data file ``rel`` (e.g. ``"philly/vc_0e4a51.csv"``); a
    path that exists on its own is returned as is."""
    p = Path(rel)
    if p.is_file():
        return p
    d = data_dir()
    full = d / rel
    if not full.is_file():
        raise DataError(f"data file {rel} not found in {d}; run `dlshare data fetch`")
    return full


def resolve_trace(name: str) -> Path:
    """A trace by path, by data-relative path, or by short name (``vc_0e4a51``, ``static_100job``)."""
    p = Path(name)
    if p.is_file():
        return p
    for rel in (name, f"philly/{name}.csv", f"synergy/{name}.csv", f"{name}.csv"):
        try:
            return path(rel)
        except DataError:
            continue
    raise DataError(f"no trace {name!r}: give a CSV path or one of vc_0e4a51, vc_103959, static_100job")


@functools.lru_cache(maxsize=None)
def _json(p: str) -> Any:
    def no_constants(name: str) -> Any:
        raise DataFormatError(f"{p}: {name} is not a number JSON allows")

    try:
        return json.loads(read_text(p), parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise DataFormatError(f"{p}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise DataFormatError(f"{p}: nested too deeply") from None


def gavel_throughputs() -> dict[str, Any]:
    """gavel/throughputs.json (Gavel, MIT): steps/s by GPU kind and job type."""
    return _json(str(path("gavel/throughputs.json")))


def synergy_sensitivity() -> dict[str, Any]:
    """synergy/sensitivity.json (Synergy, MIT): throughput by CPU x memory level."""
    return _json(str(path("synergy/sensitivity.json")))


@functools.lru_cache(maxsize=None)
def _runtimes(p: str) -> np.ndarray:
    rows = csv.reader(io.StringIO(read_text(p), newline=""))
    try:
        header = next(rows)
        if "runtime" not in header:
            raise DataFormatError(f"{p}: row 1: no column 'runtime' (header {header[:8]})")
        i = header.index("runtime")
        vals = [_number(r[i] if i < len(r) else "", p, n, "runtime", MAX_RUNTIME_S)
                for n, r in enumerate(rows, start=2) if r]
    except StopIteration:
        raise DataFormatError(f"{p}: empty file") from None
    except csv.Error as exc:
        raise DataFormatError(f"{p}: {exc}") from None
    return np.asarray([v for v in vals if v > 0], dtype=float)


def philly_runtimes() -> np.ndarray:
    """Positive Philly job runtimes in seconds (philly/runtimes.csv)."""
    return _runtimes(str(path("philly/runtimes.csv")))


def colocation_util(p: str | Path | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """iadeep/colocation_util.csv: (model names, X of SM%/mem% per model, sum_interference)."""
    p = Path(p) if p is not None else path("iadeep/colocation_util.csv")
    reader = csv.reader(io.StringIO(read_text(p), newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise DataFormatError(f"{p}: empty file") from None
    except csv.Error as exc:
        raise DataFormatError(f"{p}: row 1: {exc}") from None
    for col in ("sum_interference",):
        if col not in header:
            raise DataFormatError(f"{p}: missing column {col!r}")
    feat = [h for h in header if h.endswith("_sm") or h.endswith("_mem")]
    models = [h[:-3] for h in feat if h.endswith("_sm")]
    for m in models:
        if f"{m}_mem" not in header:
            raise DataFormatError(f"{p}: column {m}_sm has no {m}_mem")
    idx = {h: i for i, h in enumerate(header)}
    xs, ys = [], []
    try:
        for n, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DataFormatError(f"{p}: row {n} has {len(row)} fields, the header has {len(header)}")
            # utilisations are percentages, interference a small ratio: 1e6 bounds both generously
            xs.append([_number(row[idx[f"{m}_sm"]], p, n, f"{m}_sm", 1e6) for m in models]
                      + [_number(row[idx[f"{m}_mem"]], p, n, f"{m}_mem", 1e6) for m in models])
            ys.append(_number(row[idx["sum_interference"]], p, n, "sum_interference", 1e6))
    except csv.Error as exc:
        raise DataFormatError(f"{p}: {exc}") from None
    return models, np.asarray(xs, dtype=float).reshape(-1, 2 * len(models)), np.asarray(ys, dtype=float)


LUCID_SOLO = ("model", "dataset", "batchsize", "amp", "speed", "gpu_util", "gmem_util", "gmem")
LUCID_PAIR = ("model1", "dataset1", "batchsize1", "amp1", "speed1", "model2", "dataset2", "batchsize2", "amp2", "speed2")


def _lucid_rows(p: Path, need: tuple[str, ...]) -> list[dict[str, Any]]:
    with open(p, newline="") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ValueError(f"{p}: empty file") from None
        missing = [c for c in need if c not in header]
        if missing:
            raise ValueError(f"{p}: missing columns {missing} (expected Lucid's {', '.join(need)})")
        rows = []
        for n, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"{p}: row {n} has {len(row)} fields, the header has {len(header)}")
            d = dict(zip(header, row))
            out: dict[str, Any] = {}
            for c in need:
                v = d[c].strip()
                if c.startswith(("model", "dataset")):
                    if not v:
                        raise ValueError(f"{p}: row {n}: empty {c}")
                    out[c] = v
                    continue
                try:
                    x = float(v)
                except ValueError:
                    raise ValueError(f"{p}: row {n}: {c} = {v!r} is not a number") from None
                if not np.isfinite(x) or x < 0 or (c.startswith("speed") and x <= 0):
                    raise ValueError(f"{p}: row {n}: {c} = {v!r} out of range")
                if c.startswith(("batchsize", "amp")):
                    if x != int(x) or (c.startswith("amp") and x not in (0, 1)):
                        raise ValueError(f"{p}: row {n}: {c} = {v!r} must be an integer{' 0 or 1' if c.startswith('amp') else ''}")
                    x = int(x)
                out[c] = x
            rows.append(out)
    if not rows:
        raise ValueError(f"{p}: no rows")
    return rows


def lucid_solo(p: str | Path | None = None) -> list[dict[str, Any]]:
    """lucid/solo.csv (Lucid, Hu et al., ASPLOS'23): each job alone: model, dataset, batchsize,
    amp, speed (samples/s), gpu_util %, gmem_util %, gmem (MiB)."""
    return _lucid_rows(Path(p) if p is not None else path("lucid/solo.csv"), LUCID_SOLO)


def lucid_colocation(p: str | Path | None = None) -> list[dict[str, Any]]:
    """lucid/colocation.csv (Lucid, Hu et al., ASPLOS'23): two 1-GPU jobs on one GPU, each
    described by model, dataset, batchsize, amp, with its speed normalised to running alone."""
    return _lucid_rows(Path(p) if p is not None else path("lucid/colocation.csv"), LUCID_PAIR)
