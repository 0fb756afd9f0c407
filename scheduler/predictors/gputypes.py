"""Each job type's speed on each GPU generation (issue 23: clusters of several GPU types).

Gavel measured the training throughput of 26 job types (model x batch size) on 1-8 GPUs of K80s,
P100s and V100s (shared data, gavel/throughputs.json).  :class:`TypeSpeeds` turns that table into
a job's speed on a generation relative to the reference one, the V100, on which the traces'
durations were measured (the Philly VCs' "duration the job would take alone on V100s").  The
simulator runs jobs at these speeds (its ground truth), and the core's placement reads the same
table, as Gavel's heterogeneity-aware policies do (they profile every job type on every worker
type).  A job type or a generation the table does not have has no speed here (``None``): the
placement then treats every generation alike for it.
"""

from __future__ import annotations

from typing import Any

from scheduler.model import Job
from scheduler.trace import gavel_type

REFERENCE = "v100"  # the generation the traces' durations are measured on (Gavel's reference worker type)


class TypeSpeeds:
    """``speeds[gpu_type][key]``: solo throughput (steps/s) of job ``key`` (Gavel's
    ``"('Model (batch size B)', GPUs)"``) on ``gpu_type``."""

    def __init__(self, speeds: dict[str, dict[str, float]], reference: str = REFERENCE) -> None:
        self.speeds = speeds
        self.reference = reference

    @classmethod
    def from_gavel(cls, throughputs: dict[str, Any]) -> "TypeSpeeds":
        """From Gavel's table: every worker type but the "unconsolidated" variants (a job spread
        over servers, which the placement avoids)."""
        out: dict[str, dict[str, float]] = {}
        for wt, rows in throughputs.items():
            if "unconsolidated" in wt or not isinstance(rows, dict):
                continue
            out[wt.lower()] = {k: float(v["null"]) for k, v in rows.items()
                               if isinstance(v, dict) and isinstance(v.get("null"), (int, float)) and v["null"] > 0}
        return cls(out)

    @staticmethod
    def key(job: Job) -> str:
        return str((gavel_type(job.model, job.batch_size), job.gpus))

    def types(self) -> list[str]:
        return sorted(self.speeds)

    def mean_speed(self, gpu_type: str) -> float | None:
        """The mean over the job types measured on both of their speed on ``gpu_type`` against the
        reference: what one GPU of that generation is worth in reference GPUs (K80 0.29, P100 0.83
        in Gavel's table); None when unknown."""
        ref, here = self.speeds.get(self.reference, {}), self.speeds.get(gpu_type, {})
        ratios = [here[k] / ref[k] for k in here if ref.get(k)]
        return sum(ratios) / len(ratios) if ratios else None

    def speed(self, job: Job, gpu_type: str) -> float | None:
        """``job``'s speed on ``gpu_type`` over its speed on the reference (None: unknown)."""
        if not gpu_type:
            return None
        k = self.key(job)
        ref = self.speeds.get(self.reference, {}).get(k)
        here = self.speeds.get(gpu_type, {}).get(k)
        if not ref or not here:
            return None
        return here / ref


__all__ = ["REFERENCE", "TypeSpeeds"]
