"""What a byte of lent (remote) memory is worth to a training job: the one place this is modelled.

Host-memory sensitivity on DL nodes is mostly data caching: Synergy's profiles (OSDI'22) come from
input pipelines that cache decoded or raw samples, so more memory means more cache hits and fewer
reads from storage.  A cache tier on a donor serves the same hits, only from further away.  So a
remote byte is worth a local byte times an **efficiency** ``e`` in [0, 1]:

    effective memory = local + e * remote

``e`` is the share of the remote tier's read demand that the path to the donor can carry:

* the job's **input data rate** at the speed it runs at: ``batch x sample bytes / iteration time x
  speed`` (batch and iteration time from its Synergy profile; sample bytes per model family below);
* the share of its cache hits that land on the remote tier, ``remote / (local + remote)`` (uniform
  access over the cached samples), gives the **remote demand**;
* the **supply**: the least of the remote read bandwidth, what the job's loader streams can pull at
  the measured per-read latency (one sample in flight per core), and the job's share of its donor's
  bandwidth when several jobs borrow from one donor (reserved oldest borrower first,
  :func:`reserved_shares`).

``e = min(1, supply / demand)``.  Measured (``dlshare bench cache``, bench/RESULTS.md, quiet run of
2026-11-26 on the 2-vCPU development VM, loopback TCP): a real input pipeline's cached samples (150.6 kB
decoded tensors) read back from donors at 0.897 GB/s by 2 readers, a 4 KiB read at the slab server at
101 us p50 through the cache client, and a region's fault stream at 1.29 GB/s.  Assumed: that a donor
serves at most that rate to all its borrowers together (one slab server; a real NIC may carry more),
and the sample sizes below.

**Calibrated** (``dlshare bench cache``): the bench runs a real input pipeline with its sample cache
on donors and writes what the remote tier delivered (sample read rate and latency, and a region's
streaming rate) to a calibration file; :meth:`RemoteLink.from_file` reads it, and the defaults below
are the last recorded measurement.  The bench also checks the model: it predicts the cached
pipeline's speed with lent memory from its speeds with a local-only cache and an all-local one
(:func:`predicted_speed`) and reports the prediction beside the measurement.

Pure: no clock, no I/O (except :meth:`RemoteLink.from_file`, which a shell calls once at start).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

GB = 1e9

# Measured by `dlshare bench cache --quick` (bench/RESULTS.md, "cache", 2026-11-26 00:24 UTC, 2-vCPU VM,
# load 0.42 at the start; its remote_link.json).  `bench memory`'s batched page reads (2.561 GB/s,
# 22.2 us, 2026-11-21) are the data plane's micro-benchmark; these are what a pipeline's cache got:
READ_BYTES_PER_S = 0.897e9  # cached samples read back from donors, 2 readers, loopback TCP
READ_LATENCY_S = 100.9e-6  # one 4 KiB read at the slab server through the cache client, p50

# Assumed: bytes one training sample occupies in an input cache, per model family (the datasets
# Synergy's models train on).  ImageNet-1k: 138 GB of JPEGs for 1.28M training images (~108 kB each);
# LibriSpeech (DeepSpeech): ~12 s utterances of 16 kHz 16-bit audio, FLAC-compressed (~230 kB);
# M5 on UrbanSound8K-style clips: 4 s at 8 kHz as float32 (128 kB); text models (GNMT, LSTM, BERT):
# ~1 kB of token ids per sample.  Unknown models take the ImageNet figure (the conservative side).
SAMPLE_BYTES = {
    "alexnet": 108e3, "res18": 108e3, "res50": 108e3, "mobilenet": 108e3, "shufflenet": 108e3,
    "deepspeech": 230e3, "m5": 128e3, "gnmt": 1e3, "lstm": 1e3, "bert": 1e3,
}
DEFAULT_SAMPLE_BYTES = 108e3


# A region's sequential fault stream, from the same `bench cache` run (`dlshare bench paging`'s chunked
# stream moved 1.11-1.16 GB/s on 2026-11-26).  A region is not what a sample cache reads through (forked
# workers cannot share it), so this is kept for region users and the calibration file, not used by the
# cache efficiency.
REGION_BYTES_PER_S = 1.29e9
CALIBRATION_SCHEMA = 1
MAX_CALIBRATION_BYTES = 1 << 20


@dataclass(frozen=True)
class RemoteLink:
    """The named inputs of the efficiency (see the module docstring).  ``source``: where the numbers
    come from (a measurement's date and bench, or "defaults")."""

    read_bytes_per_s: float = READ_BYTES_PER_S
    read_latency_s: float = READ_LATENCY_S
    donor_bytes_per_s: float = READ_BYTES_PER_S  # assumed: one donor serves what one consumer measured
    region_bytes_per_s: float = REGION_BYTES_PER_S
    source: str = "defaults: dlshare bench cache, 2026-11-26"

    def __post_init__(self) -> None:
        nums = (self.read_bytes_per_s, self.donor_bytes_per_s, self.read_latency_s, self.region_bytes_per_s)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in nums):
            raise ValueError("remote link: every rate and latency must be a finite number")
        if not (self.read_bytes_per_s > 0 and self.donor_bytes_per_s > 0 and self.region_bytes_per_s > 0
                and 0 <= self.read_latency_s <= 10):
            raise ValueError("remote link: bandwidths must be > 0 and latency in [0, 10] s")

    @classmethod
    def from_calibration(cls, doc: Any) -> "RemoteLink":
        """The link a calibration document describes (``dlshare bench cache`` writes one):
        ``{"schema": 1, "measured": ISO time, "bench": ..., "link": {read_bytes_per_s, read_latency_s,
        donor_bytes_per_s?, region_bytes_per_s?}}``.  Anything else is a ValueError naming the field."""
        if not isinstance(doc, dict) or doc.get("schema") != CALIBRATION_SCHEMA:
            raise ValueError(f"a remote-link calibration is a JSON object with schema {CALIBRATION_SCHEMA}")
        link = doc.get("link")
        if not isinstance(link, dict):
            raise ValueError("calibration: 'link' must be an object")
        known = {f.name for f in fields(cls)} - {"source"}
        extra = set(link) - known
        if extra:
            raise ValueError(f"calibration: unknown field(s) {sorted(extra)}")
        for need in ("read_bytes_per_s", "read_latency_s"):
            if need not in link:
                raise ValueError(f"calibration: 'link.{need}' is missing")
        vals = {}
        for k, v in link.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > 1e15:
                raise ValueError(f"calibration: 'link.{k}' must be a finite number, got {v!r}")
            vals[k] = float(v)
        vals.setdefault("donor_bytes_per_s", vals["read_bytes_per_s"])
        when = doc.get("measured")
        bench = doc.get("bench")
        source = f"{bench if isinstance(bench, str) else 'calibration'}, {when if isinstance(when, str) else '?'}"
        return cls(**vals, source=source[:200])

    @classmethod
    def from_file(cls, path: str) -> "RemoteLink":
        """:meth:`from_calibration` of a JSON file (UTF-8, at most 1 MiB); errors name the file."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_CALIBRATION_BYTES + 1)
            if len(raw) > MAX_CALIBRATION_BYTES:
                raise ValueError(f"larger than {MAX_CALIBRATION_BYTES} bytes")
            return cls.from_calibration(json.loads(raw.decode("utf-8-sig")))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not a remote-link calibration: {exc}") from None

    def calibration(self, measured: str, bench: str, **extra: Any) -> dict[str, Any]:
        """The document :meth:`from_calibration` reads back."""
        return {"schema": CALIBRATION_SCHEMA, "measured": measured, "bench": bench, **extra,
                "link": {"read_bytes_per_s": self.read_bytes_per_s, "read_latency_s": self.read_latency_s,
                         "donor_bytes_per_s": self.donor_bytes_per_s, "region_bytes_per_s": self.region_bytes_per_s}}

    def stream_bytes_per_s(self, sample_bytes: float, streams: float) -> float:
        """What ``streams`` loader streams pull, one sample in flight each, at the measured latency."""
        per = sample_bytes / (self.read_latency_s + sample_bytes / self.read_bytes_per_s)
        return max(1.0, streams) * per


def input_rate(sens: Any, model: str, gpus: int, speed: float) -> float:
    """Bytes per second the job reads from its input cache at ``speed`` (1.0 = the GPU-proportional
    share's throughput), from its Synergy profile (batch size, iteration time); 0 when unknown."""
    meta = sens.meta(model, gpus) if sens is not None and hasattr(sens, "meta") else None
    if not meta or not meta.get("iter_time_s"):
        return 0.0
    sample = SAMPLE_BYTES.get(model, DEFAULT_SAMPLE_BYTES)
    # Assumed: the profile's batch is per GPU (data parallel), so the rate grows with the GPUs.
    return float(meta["batch_size"]) * sample * max(1, gpus) / float(meta["iter_time_s"]) * max(0.0, speed)


def remote_demand(rate: float, local_bytes: float, remote_bytes: float) -> float:
    """The part of ``rate`` that lands on the remote tier (uniform access over the cached samples)."""
    total = local_bytes + remote_bytes
    return rate * (remote_bytes / total) if total > 0 and remote_bytes > 0 else 0.0


def efficiency(demand: float, supply: float) -> float:
    """``min(1, supply / demand)``; 1 when nothing is demanded."""
    if demand <= 0:
        return 1.0
    return max(0.0, min(1.0, supply / demand))


def reserved_shares(demands: dict[Any, float], capacity: float) -> dict[Any, float]:
    """A donor's ``capacity`` (bytes/s) reserved to its borrowers' ``demands`` in the order given
    (oldest borrower first): each gets what is left after the older ones, so a newcomer never takes
    read rate an older borrower's level depends on (the core admits a borrower only at the
    efficiency what is left gives it)."""
    out: dict[Any, float] = {}
    left = max(0.0, capacity)
    for key, d in demands.items():
        out[key] = min(max(0.0, d), left) if d > 0 else left
        left = max(0.0, left - max(0.0, d))
    return out


def effective_memory(local_bytes: float, remote_bytes: float, e: float) -> float:
    return local_bytes + max(0.0, e) * remote_bytes


def predicted_speed(speed_partial: float, hit_partial: float, speed_full: float, e: float) -> float:
    """A cache-bound pipeline's speed with lent memory, from two measured points: ``speed_partial``
    when a share ``hit_partial`` of its reads hit a local-only cache, ``speed_full`` when every read
    hits.  The lent bytes hold the rest of the samples at efficiency ``e`` (effective memory, as
    above), so the effective hit share is ``h = hit_partial + e (1 - hit_partial)``; the time per
    sample is interpolated linearly in the hit share between the two points (a hit and a miss each
    cost a fixed time)."""
    if not (speed_partial > 0 and speed_full > 0 and 0 <= hit_partial < 1):
        raise ValueError("predicted_speed: speeds must be > 0 and hit_partial in [0, 1)")
    h = hit_partial + max(0.0, min(1.0, e)) * (1.0 - hit_partial)
    t = 1.0 / speed_full + (1.0 - h) / (1.0 - hit_partial) * (1.0 / speed_partial - 1.0 / speed_full)
    return 1.0 / t


__all__ = ["RemoteLink", "input_rate", "remote_demand", "efficiency", "reserved_shares", "effective_memory",
           "predicted_speed", "SAMPLE_BYTES", "READ_BYTES_PER_S", "READ_LATENCY_S", "REGION_BYTES_PER_S"]
