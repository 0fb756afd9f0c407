"""Predictors the placement and allocation plugins consult, bundled as :class:`Predictors`.

* :class:`~scheduler.predictors.interference.InterferencePredictor`: SM% and
  memory% of a co-located set -> its slowdown (IADeep data).
* :class:`~scheduler.predictors.utilisation.UtilisationPredictor`: torch.fx
  graph features -> GPU utilisation (Horus).
* :class:`~scheduler.predictors.sensitivity.SensitivityModel`: CPU/memory ->
  speed (Synergy tables).
* :class:`PairSpeeds`: speeds of job types when they share a GPU, learned
  online from node reports (``JobSample.speed``), with the interference
  predictor as the prior where utilisations are known.

``Predictors.observe`` is the online path: the core calls it with every
:class:`~scheduler.events.JobSample` a node reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.model import Job


@dataclass
class PairSpeeds:
    """Running means of a job type's normalised speed next to a set of other types."""

    # Unknown pairs: slightly optimistic, so each pairing is tried once and then judged on
    # its measured speeds (the online path); 0.5 each would be plain time-slicing.
    prior_speed: float = 0.6
    sums: dict[tuple[str, tuple[str, ...]], list[float]] = field(default_factory=dict)

    def observe(self, job_type: str, others: tuple[str, ...], speed: float) -> None:
        k = (job_type, tuple(sorted(others)))
        s = self.sums.setdefault(k, [0.0, 0.0])
        s[0] += speed
        s[1] += 1.0

    def get(self, job_type: str, others: Sequence[str]) -> float | None:
        s = self.sums.get((job_type, tuple(sorted(others))))
        return s[0] / s[1] if s else None


@dataclass
class Predictors:
    interference: Any = None
    utilisation: Any = None
    sensitivity: Any = None
    pairs: PairSpeeds = field(default_factory=PairSpeeds)
    alone_util: dict[str, tuple[float, float]] = field(default_factory=dict)
    default_util: tuple[float, float] = (50.0, 25.0)
    _memo: dict[tuple, float] = field(default_factory=dict, repr=False)

    @classmethod
    def default(cls) -> "Predictors":
        """Uninformed predictors: learn from node reports only."""
        return cls()

    @classmethod
    def from_data(cls, seed: int = 0) -> "Predictors":
        """Interference and sensitivity models trained on the shared data."""
        from scheduler.predictors.interference import InterferencePredictor
        from scheduler.predictors.sensitivity import SensitivityModel

        return cls(interference=InterferencePredictor.from_data(seed=seed), sensitivity=SensitivityModel.from_data())

    def observe(self, job_type: str, others: tuple[str, ...], sample: Any) -> None:
        if sample.speed is not None and others:
            self.pairs.observe(job_type, others, float(sample.speed))
        if not others and sample.sm_percent is not None and sample.mem_percent is not None:
            self.alone_util[job_type] = (float(sample.sm_percent), float(sample.mem_percent))

    def utilisation_of(self, job: Job) -> tuple[float, float]:
        """(SM %, mem %) of ``job`` alone: measured, else predicted from graph features, else a default."""
        u = self.alone_util.get(job.job_type)
        if u is not None:
            return u
        if self.utilisation is not None and job.features:
            try:
                return self.utilisation.predict_one(job.features, job.batch_size)
            except RuntimeError:
                pass
        return self.default_util

    def colocated_speeds(self, new_type: str, resident_types: Sequence[str], new_job: Job | None = None,
                         residents: Sequence[Job] = ()) -> list[float]:
        """Predicted speeds [new job, resident...] if they share a device."""
        types = [new_type, *resident_types]
        out: list[float] = []
        for i, t in enumerate(types):
            others = types[:i] + types[i + 1:]
            s = self.pairs.get(t, others)
            out.append(s if s is not None else float("nan"))
        if any(v != v for v in out):  # some unknown: fall back on the utilisation model or the prior
            jobs = [new_job, *residents] if new_job is not None and len(residents) == len(resident_types) else None
            if self.interference is not None and jobs is not None:
                utils = [self.utilisation_of(j) for j in jobs]
                key = tuple(sorted((round(a, 1), round(b, 1)) for a, b in utils))
                total = self._memo.get(key)
                if total is None:  # a model call costs ~0.1 ms: remember it per utilisation set
                    total = self._memo[key] = float(self.interference.predict([utils])[0])
                # IADeep's sum_interference is the summed relative slowdown: split it evenly.
                each = 1.0 / (1.0 + total / len(types))
                out = [v if v == v else each for v in out]
            else:
                out = [v if v == v else self.pairs.prior_speed for v in out]
        return out
