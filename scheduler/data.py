"""The shared data directory: where it is, and loaders for each file.

Resolution order: ``$DLSHARE_DATA``; else ``../shared/data`` beside the
checkout; else the user cache (``$XDG_CACHE_HOME/dlshare/data``) that
``dlshare data fetch`` fills (:mod:`scheduler.fetch`).  Files are never
committed to the project.  The loaders cache their result per path.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FILES = (
    "philly/vc_0e4a51.csv", "philly/vc_103959.csv", "philly/runtimes.csv", "gavel/throughputs.json",
    "iadeep/colocation_util.csv", "iadeep/offline_info.csv", "synergy/sensitivity.json",
    "synergy/static_100job.csv", "lucid/colocation.csv", "lucid/solo.csv",
)


class DataError(FileNotFoundError):
    """A data file is missing; the message says where it looked and how to fetch it."""


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
    with open(p) as f:
        return json.load(f)


def gavel_throughputs() -> dict[str, Any]:
    """gavel/throughputs.json (Gavel, MIT): steps/s by GPU kind and job type."""
    return _json(str(path("gavel/throughputs.json")))


def synergy_sensitivity() -> dict[str, Any]:
    """synergy/sensitivity.json (Synergy, MIT): throughput by CPU x memory level."""
    return _json(str(path("synergy/sensitivity.json")))


@functools.lru_cache(maxsize=None)
def _runtimes(p: str) -> np.ndarray:
    with open(p) as f:
        rows = csv.DictReader(f)
        vals = [float(r["runtime"]) for r in rows]
    return np.asarray([v for v in vals if v > 0], dtype=float)


def philly_runtimes() -> np.ndarray:
    """Positive Philly job runtimes in seconds (philly/runtimes.csv)."""
    return _runtimes(str(path("philly/runtimes.csv")))


def colocation_util(p: str | Path | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """iadeep/colocation_util.csv: (model names, X of SM%/mem% per model, sum_interference)."""
    p = Path(p) if p is not None else path("iadeep/colocation_util.csv")
    with open(p, newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{p}: empty file") from None
        for col in ("sum_interference",):
            if col not in header:
                raise ValueError(f"{p}: missing column {col!r}")
        feat = [h for h in header if h.endswith("_sm") or h.endswith("_mem")]
        models = [h[:-3] for h in feat if h.endswith("_sm")]
        for m in models:
            if f"{m}_mem" not in header:
                raise ValueError(f"{p}: column {m}_sm has no {m}_mem")
        idx = {h: i for i, h in enumerate(header)}
        xs, ys = [], []
        for n, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"{p}: row {n} has {len(row)} fields, the header has {len(header)}")
            try:
                x = [float(row[idx[f"{m}_sm"]]) for m in models] + [float(row[idx[f"{m}_mem"]]) for m in models]
                y = float(row[idx["sum_interference"]])
            except ValueError as exc:
                raise ValueError(f"{p}: row {n}: {exc}") from None
            xs.append(x)
            ys.append(y)
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
