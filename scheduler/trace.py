"""Trace files for the simulator, parsed strictly.

Two formats are read (the header decides):

* Philly/Gavel (``philly/vc_*.csv``): ``job_id, arrival_s, model, batch_size,
  num_gpus, total_steps, isolated_duration_s``.
* Synergy (``synergy/static_100job.csv``): ``job_id, model, arrival_h,
  iterations, num_gpus``; the duration is ``iterations x iter_time_s`` of the
  model's Synergy profile (at the GPU-proportional CPU/memory share).

Mixed GPU/CPU traces: the Philly/Gavel format with two more columns, ``num_cpus``
and ``memory_gb`` (GB = 10^9 bytes).  A row with ``num_gpus = 0`` is a CPU-only
(data-preparation) job: it must give ``num_cpus > 0`` and gets exactly those
cores and that memory; its model is free text (not looked up in Gavel's table)
and ``isolated_duration_s`` is its run time.  On a GPU row the two columns are
an explicit request (0 or empty: the allocation plugin decides)::

    job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s,num_cpus,memory_gb
    1,0,ResNet-18,32,1,1000,3600,,
    2,60,decode-imagenet,0,0,0,1800,8,32

Owners: the Philly/Gavel format may carry ``user`` and ``account`` columns (either or both; free
text, may be empty): fair share and quotas count per user and account (``bench/sched_fairshare.py``
assigns synthetic users to the shared traces).

Any bad row raises :class:`TraceError` naming the file, the row (1-based,
header = row 1) and the column.  Files are UTF-8 (a byte-order mark is
ignored), at most ``MAX_TRACE_BYTES``; every number has a finite bound
(``MAX_*`` below), since a trace row beyond them is a unit mistake or garbage and
would make the simulator print nonsense (a mean JCT of 1e304 h, nan utilisations).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHILLY = ("job_id", "arrival_s", "model", "batch_size", "num_gpus", "total_steps", "isolated_duration_s")
SYNERGY = ("job_id", "model", "arrival_h", "iterations", "num_gpus")
RESOURCES = ("num_cpus", "memory_gb")  # optional, Philly/Gavel format: CPU-only rows and explicit requests
OWNERS = ("user", "account")  # optional, Philly/Gavel format: who submitted the job
GB = 10**9

# Bounds, each far above the public traces (Philly vc_0e4a51/vc_103959: arrivals < 8e6 s, durations
# < 1.8e6 s, 8 GPUs, batch 8192, 1.3e8 steps; Synergy: 2.3e6 iterations).
MAX_TRACE_BYTES = 256 << 20  # ~5M rows; Philly's whole 117k-job trace is ~10 MB
MAX_SECONDS = 1e9            # arrivals and durations: 31 years
MAX_GPUS = 1 << 17           # more GPUs than the largest cluster built
MAX_BATCH = 1 << 24
MAX_STEPS = 10 ** 12
MAX_NAME = 256               # job ids and model names
_BOUND = {"arrival_s": MAX_SECONDS, "arrival_h": MAX_SECONDS / 3600, "isolated_duration_s": MAX_SECONDS,
          "num_gpus": MAX_GPUS, "batch_size": MAX_BATCH, "total_steps": MAX_STEPS, "iterations": MAX_STEPS}


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the row."""


@dataclass(frozen=True)
class TraceJob:
    id: str
    arrival_s: float
    model: str
    batch_size: int
    gpus: int
    steps: int
    duration_s: float  # isolated run time at the trace's GPU count
    cpus: float = 0.0  # requested cores (0: the allocation plugin decides; CPU-only jobs always ask)
    memory_bytes: int = 0
    user: str = ""  # the owner (fair share, quotas); empty: the anonymous user
    account: str = ""


def gavel_type(model: str, batch_size: int) -> str:
    """Gavel's job-type string for a model and batch size."""
    return f"{model} (batch size {batch_size})" if batch_size else model


def parse_trace(text: str, source: str = "<trace>", throughputs: dict[str, Any] | None = None,
                sensitivity: dict[str, Any] | None = None) -> list[TraceJob]:
    """Parse trace CSV ``text``.  ``throughputs`` (Gavel's v100 table) and
    ``sensitivity`` (Synergy's models) are used to reject unknown models."""
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise TraceError(f"{source}: empty trace") from None
    except csv.Error as exc:
        raise TraceError(f"{source}: row 1 (header): {exc}") from None
    if set(PHILLY) <= set(header):
        kind = "philly"
    elif set(SYNERGY) <= set(header):
        kind = "synergy"
    else:
        missing_p = [c for c in PHILLY if c not in header]
        missing_s = [c for c in SYNERGY if c not in header]
        missing = missing_p if len(missing_p) <= len(missing_s) else missing_s
        raise TraceError(f"{source}: row 1 (header): missing columns {missing}")
    col = {h: i for i, h in enumerate(header)}
    resources = kind == "philly" and all(c in col for c in RESOURCES)
    if kind == "philly" and not resources and any(c in col for c in RESOURCES):
        raise TraceError(f"{source}: row 1 (header): give both {RESOURCES[0]} and {RESOURCES[1]}, or neither")
    out: list[TraceJob] = []
    seen: set[str] = set()
    for n, row in _rows(reader, source):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TraceError(f"{source}: row {n}: {len(row)} fields, header has {len(header)}")

        def get(name: str, typ: type, row=row, n=n) -> Any:
            raw = row[col[name]].strip()
            try:
                v = typ(float(raw)) if typ is int else typ(raw)
            except OverflowError:  # int(float("inf"))
                raise TraceError(f"{source}: row {n}: column {name}: must be finite and >= 0, got {raw!r}") from None
            except ValueError:
                raise TraceError(f"{source}: row {n}: column {name}: not a {typ.__name__}: {raw!r}") from None
            if typ in (int, float) and (not math.isfinite(v) or v < 0):
                raise TraceError(f"{source}: row {n}: column {name}: must be finite and >= 0, got {raw!r}")
            if v > _BOUND.get(name, math.inf):
                raise TraceError(f"{source}: row {n}: column {name}: {raw!r} is above the bound {_BOUND[name]:g}")
            if typ is int and float(raw) != int(float(raw)):
                raise TraceError(f"{source}: row {n}: column {name}: not a whole number: {raw!r}")
            return v

        jid = row[col["job_id"]].strip()
        if not jid:
            raise TraceError(f"{source}: row {n}: empty job_id")
        if len(jid) > MAX_NAME or len(row[col["model"]]) > MAX_NAME:
            raise TraceError(f"{source}: row {n}: job_id and model are at most {MAX_NAME} characters")
        if jid in seen:
            raise TraceError(f"{source}: row {n}: duplicate job_id {jid!r}")
        seen.add(jid)
        model = row[col["model"]].strip()
        if not model:
            raise TraceError(f"{source}: row {n}: empty model")
        gpus = get("num_gpus", int)
        cpus, mem = 0.0, 0
        if resources:
            cpus = get("num_cpus", float) if row[col["num_cpus"]].strip() else 0.0
            mem = int(get("memory_gb", float) * GB) if row[col["memory_gb"]].strip() else 0
            if gpus == 0 and not cpus > 0:
                raise TraceError(f"{source}: row {n}: column num_cpus: a CPU-only row (num_gpus 0) needs num_cpus > 0")
        if gpus < 1 and not resources:
            raise TraceError(f"{source}: row {n}: column num_gpus: must be >= 1 (CPU-only rows need the "
                             f"{RESOURCES[0]} and {RESOURCES[1]} columns)")
        if kind == "philly":
            bs = get("batch_size", int)
            arrival = get("arrival_s", float)
            steps = get("total_steps", int)
            dur = get("isolated_duration_s", float)
            if gpus and throughputs is not None and str((gavel_type(model, bs), gpus)) not in throughputs:
                raise TraceError(f"{source}: row {n}: unknown model {gavel_type(model, bs)!r} on {gpus} GPUs "
                                 "(not in gavel/throughputs.json v100)")
        else:
            bs = 0
            arrival = get("arrival_h", float) * 3600.0
            steps = get("iterations", int)
            prof = None
            if sensitivity is not None:
                prof = sensitivity.get(f"{model}_{gpus}") or sensitivity.get(f"{model}_1")
                if prof is None:
                    raise TraceError(f"{source}: row {n}: unknown model {model!r} (not in synergy/sensitivity.json)")
            dur = steps * float(prof["iter_time_s"]) if prof else float(steps)
        if not 0 < dur <= MAX_SECONDS:
            raise TraceError(f"{source}: row {n}: duration {dur:g} s must be > 0 and at most {MAX_SECONDS:g}")
        owner = {}
        for c in OWNERS:
            if kind == "philly" and c in col:
                v = row[col[c]].strip()
                if len(v) > MAX_NAME:
                    raise TraceError(f"{source}: row {n}: column {c}: at most {MAX_NAME} characters")
                owner[c] = v
        out.append(TraceJob(jid, arrival, model, bs, gpus, steps, dur, cpus, mem, **owner))
    if not out:
        raise TraceError(f"{source}: no jobs")
    out.sort(key=lambda j: (j.arrival_s, j.id))
    return out


def _rows(reader: Any, source: str) -> Any:
    n = 1
    while True:
        n += 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceError(f"{source}: row {n}: {exc}") from None
        yield n, row


def decode_trace(raw: bytes, source: str = "<trace>") -> str:
    """Trace bytes as text: UTF-8, a byte-order mark dropped; bytes that are not UTF-8 are a
    :class:`TraceError` naming the row they are on."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        row = raw.count(b"\n", 0, exc.start) + 1
        raise TraceError(f"{source}: row {row}: not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
                         "a trace is a CSV file") from None


def load_trace(path: str | Path, *, check_models: bool = True) -> list[TraceJob]:
    """Read and parse a trace file (see :func:`parse_trace`); at most MAX_TRACE_BYTES are read."""
    from scheduler.data import read_capped

    p = Path(path)
    raw = read_capped(p, MAX_TRACE_BYTES, TraceError)
    text = decode_trace(raw, str(p))
    thr = sens = None
    if check_models:
        from scheduler import data

        thr = data.gavel_throughputs()["v100"]
        sens = data.synergy_sensitivity()["models"]
    return parse_trace(text, str(p), thr, sens)
