"""Predictors the placement and allocation plugins consult, bundled as :class:`Predictors`.

* :class:`~scheduler.predictors.colocation.CoLocationPredictor`: the solo
  profiles of two jobs (SM %, memory %, GPU memory, batch size, AMP) -> each
  one's speed when they share a GPU (Lucid's measured co-locations).
* :class:`~scheduler.predictors.interference.InterferencePredictor`: SM% and
  memory% of a co-located set -> its slowdown (IADeep data; for sets of more
  than two, or where the co-location predictor is absent).
* :class:`~scheduler.predictors.utilisation.UtilisationPredictor`: torch.fx
  graph features -> GPU utilisation (Horus).
* :class:`~scheduler.predictors.sensitivity.SensitivityModel`: CPU/memory ->
  speed (Synergy tables).
* :class:`PairSpeeds`: speeds of job types when they share a GPU, learned
  online from node reports (``JobSample.speed``).

``Predictors.colocated_speeds`` answers from what a live system knows, in this
order: the measured speeds of that set of job types, once seen; else the
co-location predictor on the jobs' solo profiles (utilisation measured while
each ran alone, or predicted from its graph features, plus its spec); else the
IADeep model; else an optimistic prior (each pairing is then tried once and
judged on its measured speeds).

``Predictors.observe`` is the online path: the core calls it with every
:class:`~scheduler.events.JobSample` a node reports.  Solo samples fill the
profiles; measured pairs go to :class:`PairSpeeds` and, every
``update_every`` new pairs, into the co-location predictor's ``update``.
"""

from __future__ import annotations

import copy
import functools
import math
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
    colocation: Any = None
    type_speeds: Any = None  # scheduler.predictors.gputypes.TypeSpeeds: each job's speed per GPU generation
    update_every: int = 25  # new measured pairs between two refits of the co-location predictor (a refit: ~2 s)
    _memo: dict[tuple, float] = field(default_factory=dict, repr=False)
    _spec: dict[str, tuple[int, float, bool, str]] = field(default_factory=dict, repr=False)
    _pair_seen: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict, repr=False)
    _pending: list[tuple[Any, Any, float, float]] = field(default_factory=list, repr=False)

    @classmethod
    def default(cls) -> "Predictors":
        """Uninformed predictors: learn from node reports only."""
        return cls()

    @classmethod
    def from_data(cls, seed: int = 0) -> "Predictors":
        """Co-location, interference and sensitivity models trained on the shared data."""
        from scheduler.predictors.interference import InterferencePredictor
        from scheduler.predictors.sensitivity import SensitivityModel

        return cls(interference=InterferencePredictor.from_data(seed=seed), sensitivity=SensitivityModel.from_data(),
                   colocation=trained_colocation(seed), type_speeds=gavel_type_speeds())

    def gpu_worth(self, gpu_type: str) -> float:
        """One GPU of ``gpu_type`` in reference GPUs (the mean speed of the measured job types
        there); 1 when unknown or untyped."""
        if self.type_speeds is None or not gpu_type:
            return 1.0
        v = self.type_speeds.mean_speed(gpu_type)
        return v if v else 1.0

    def type_speed(self, job: Job, gpu_type: str) -> float | None:
        """``job``'s speed on GPUs of ``gpu_type`` relative to the reference generation (the V100);
        None when unknown (no table, an untyped node, a job type never measured there)."""
        if self.type_speeds is None or not gpu_type:
            return None
        return self.type_speeds.speed(job, gpu_type)

    def observe(self, job_type: str, others: tuple[str, ...], sample: Any) -> None:
        if sample.speed is not None and others:
            self.pairs.observe(job_type, others, float(sample.speed))
            if len(others) == 1:
                self._observe_pair(job_type, others[0], float(sample.speed))
        if not others and sample.sm_percent is not None and sample.mem_percent is not None:
            self.alone_util[job_type] = (float(sample.sm_percent), float(sample.mem_percent))

    def _observe_pair(self, job_type: str, other: str, speed: float) -> None:
        """Both sides of a pair measured, and both solo profiles known: a new training row."""
        if self.colocation is None or job_type == other:
            return
        key = (job_type, other) if job_type < other else (other, job_type)
        seen = self._pair_seen.setdefault(key, {})
        if "done" in seen:
            return
        seen[job_type] = speed
        a, b = self._profile_of_type(key[0]), self._profile_of_type(key[1])
        if len(seen) < 2 or a is None or b is None:
            return
        seen["done"] = 1.0
        self._pending.append((a, b, seen[key[0]], seen[key[1]]))
        if len(self._pending) >= self.update_every:
            rows, self._pending = self._pending, []
            self.colocation.update([(a, b) for a, b, _, _ in rows], [(x, y) for _, _, x, y in rows])
            self._memo.clear()

    def remember(self, job: Job) -> None:
        """Keep the spec of ``job``'s type (batch size, GPU memory, AMP, model) for its profile."""
        if job.job_type not in self._spec:
            gmem = job.gpu_memory_bytes / float(1 << 20) if job.gpu_memory_bytes else math.nan
            amp = bool((job.features or {}).get("amp", 0))
            self._spec[job.job_type] = (job.batch_size, gmem, amp, job.model)

    def _profile_of_type(self, job_type: str) -> Any:
        u = self.alone_util.get(job_type)
        spec = self._spec.get(job_type)
        if u is None or spec is None:
            return None
        from scheduler.predictors.colocation import SoloProfile

        bs, gmem, amp, model = spec
        return SoloProfile(u[0], u[1], gmem, bs, amp, model)

    def solo_profile(self, job: Job) -> Any:
        """``job``'s :class:`~scheduler.predictors.colocation.SoloProfile`: utilisation
        measured while its type ran alone (else predicted from its graph features),
        with its spec; ``None`` when its utilisation is unknown."""
        self.remember(job)
        p = self._profile_of_type(job.job_type)
        if p is None and self.utilisation is not None and job.features:
            try:
                sm, mem = self.utilisation.predict_one(job.features, job.batch_size)
            except RuntimeError:
                return None
            from scheduler.predictors.colocation import SoloProfile

            bs, gmem, amp, model = self._spec[job.job_type]
            p = SoloProfile(sm, mem, gmem, bs, amp, model)
        return p

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
        if any(v != v for v in out):  # some unknown: fall back on the predictors or the prior
            jobs = [new_job, *residents] if new_job is not None and len(residents) == len(resident_types) else None
            if self.colocation is not None and jobs is not None and len(jobs) == 2:
                pa, pb = self.solo_profile(jobs[0]), self.solo_profile(jobs[1])
                if pa is not None and pb is not None:
                    key = ("pair", _memo_key(pa), _memo_key(pb))
                    got = self._memo.get(key)
                    if got is None:  # a model call costs ~1 ms: remember it per pair of profiles
                        got = self._memo[key] = self.colocation.predict_one(pa, pb)
                    return [v if v == v else p for v, p in zip(out, got)]
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


def gavel_type_speeds() -> Any:
    """Per-generation speeds from Gavel's throughputs (shared data); None without the data."""
    from scheduler import data
    from scheduler.predictors.gputypes import TypeSpeeds

    try:
        return TypeSpeeds.from_gavel(data.gavel_throughputs())
    except (OSError, ValueError):
        return None


def _memo_key(p: Any) -> tuple:
    """A profile as a dict key: NaN (unknown) never equals itself, so it becomes None."""
    return tuple(None if isinstance(v, float) and v != v else v for v in
                 (p.gpu_util, p.gmem_util, p.gmem_mib, p.batch_size, p.amp, p.model))


@functools.lru_cache(maxsize=4)
def _trained(seed: int) -> Any:
    from scheduler.predictors.colocation import CoLocationPredictor

    return CoLocationPredictor.from_data(seed=seed)


class LazyCoLocation:
    """The co-location predictor, trained on lucid/ at its first use, so a run whose
    profile never shares a GPU never pays for the training (a few seconds)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._model: Any = None

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = trained_colocation(self.seed)
        return self._model

    def predict_one(self, a: Any, b: Any) -> tuple[float, float]:
        return self.model.predict_one(a, b)

    def predict(self, pairs: Any) -> Any:
        return self.model.predict(pairs)

    def update(self, pairs: Any, speeds: Any) -> None:
        self.model.update(pairs, speeds)


def trained_colocation(seed: int = 0) -> Any:
    """A private copy of the co-location predictor trained on lucid/ (trained once per process)."""
    return copy.deepcopy(_trained(seed))
