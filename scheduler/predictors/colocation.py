"""Co-location predictor: from the solo profiles of two jobs that would share a
GPU to each one's speed there (normalised to its speed alone).

Input: each job's :class:`SoloProfile`, the figures NVML telemetry gives for a
job running alone (SM utilisation %, memory-controller utilisation %, GPU
memory in use) plus its spec (batch size, AMP).  Output: each job's speed when
the two share the device.  Nothing names the model, so a model never seen is
still predicted.

Trained on lucid/colocation.csv joined with lucid/solo.csv (Lucid, Hu et al.,
ASPLOS'23: 1,061 measured co-locations over 42 model pairs).  Each row gives
two samples, one per job, with the features of the job, of its partner and of
the pair (summed utilisation, the share of the SM the job would get if the
device were time-sliced in proportion to utilisation).

The model is gradient-boosted trees (scikit-learn's histogram GBRT, which
also routes unknown features, e.g. a footprint nobody declared).
:class:`HybridCoLocation` adds IASP's collaborative-filtering idea: per-model
and per-job biases, as the job that slows and as the job that slows others,
fitted on the boosted model's out-of-fold residuals over the job x job matrix.

:func:`cross_validate` is grouped by *model pair*: all rows of a pair (every
batch size and AMP variant) fall in one fold, so a fold's test pairs were
never seen together in training.  That is the question a scheduler asks; a
random split would let a pair's other batch sizes leak into training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

NAN = float("nan")


@dataclass(frozen=True)
class SoloProfile:
    """A job alone on a GPU: what telemetry and its spec say.  ``gmem_mib`` may be
    NaN (unknown); ``model`` names the job only for the hybrid's biases."""

    gpu_util: float  # SM busy, % (NVML utilization.gpu)
    gmem_util: float  # memory controller busy, % (NVML utilization.memory)
    gmem_mib: float = NAN  # GPU memory in use, MiB
    batch_size: int = 0
    amp: bool = False
    model: str = ""

    @property
    def key(self) -> str:
        return f"{self.model}@{self.batch_size}{'+amp' if self.amp else ''}"


def _log2(x: float) -> float:
    return math.log2(x) if x == x and x > 0 else NAN


def _own(p: SoloProfile) -> list[float]:
    return [p.gpu_util, p.gmem_util, _log2(p.gmem_mib), float(p.amp), _log2(p.batch_size)]


def job_features(job: SoloProfile, partner: SoloProfile) -> list[float]:
    """Features of ``job`` sharing a GPU with ``partner``: both profiles, then the pair's."""
    u = job.gpu_util + partner.gpu_util
    mem = job.gmem_mib + partner.gmem_mib
    return [*_own(job), *_own(partner), u, job.gmem_util + partner.gmem_util, _log2(mem),
            min(1.0, 100.0 / max(u, 1e-9)), job.gpu_util / max(u, 1e-9)]


def plain_features(job: SoloProfile, partner: SoloProfile) -> list[float]:
    """The two profiles side by side, nothing derived: the plain baseline's features."""
    return [*_own(job), *_own(partner)]


def mape(y_true: Sequence[float], y_pred: Sequence[float]) -> float:
    t = np.asarray(y_true, dtype=float)
    return float(np.mean(np.abs(np.asarray(y_pred, dtype=float) - t) / np.maximum(np.abs(t), 1e-9)))


Pair = tuple[SoloProfile, SoloProfile]


def _samples(pairs: Sequence[Pair], speeds: Sequence[tuple[float, float]] | None = None):
    """Two samples per pair: (job, partner) then (partner, job)."""
    sides = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]
    y = None
    if speeds is not None:
        s = np.asarray(speeds, dtype=float).reshape(-1, 2)
        y = np.concatenate([s[:, 0], s[:, 1]])
    return sides, y


class CoLocationPredictor:
    """``fit(pairs, speeds)``, ``predict(pairs) -> (n, 2)``, ``update(pairs, speeds)``
    (measured pairs from telemetry: appended, then refitted).  Trees fitted to the
    log of the speed."""

    def __init__(self, seed: int = 0, iterations: int = 300) -> None:
        self.seed = seed
        self.iterations = iterations
        self._pairs: list[Pair] = []
        self._speeds: list[tuple[float, float]] = []
        self.model = None

    def _new(self):
        from sklearn.ensemble import HistGradientBoostingRegressor

        # Small learning rate, shallow trees, 20-sample leaves: 2,000 noisy rows (speeds of one
        # configuration vary by ~0.09 between runs), so bias toward smooth, simple fits.
        return HistGradientBoostingRegressor(max_iter=self.iterations, learning_rate=0.05, max_leaf_nodes=15,
                                             min_samples_leaf=20, random_state=self.seed)

    @staticmethod
    def _check(pairs: Sequence[Pair], speeds: Sequence[tuple[float, float]]) -> None:
        if len(pairs) != len(speeds) or not len(pairs):
            raise ValueError("need as many speed pairs as job pairs, and at least one")
        s = np.asarray(speeds, dtype=float)
        if s.shape != (len(pairs), 2) or not np.all(np.isfinite(s)) or np.any(s <= 0):
            raise ValueError("speeds must be (speed of the first, speed of the second) pairs, finite and > 0")

    def _fit(self) -> None:
        from threadpoolctl import threadpool_limits

        sides, y = _samples(self._pairs, self._speeds)
        # Fitted on log speed: the error that matters is relative (a speed is a ratio), and
        # least squares in log space is least relative error to first order.
        with threadpool_limits(1):  # one thread: this runs inside a scheduler, beside other work
            self.model = self._new().fit(np.asarray([job_features(a, b) for a, b in sides]), np.log(y))

    def fit(self, pairs: Sequence[Pair], speeds: Sequence[tuple[float, float]]) -> "CoLocationPredictor":
        self._check(pairs, speeds)
        self._pairs = list(pairs)
        self._speeds = [(float(a), float(b)) for a, b in speeds]
        self._fit()
        return self

    def update(self, pairs: Sequence[Pair], speeds: Sequence[tuple[float, float]]) -> None:
        self._check(pairs, speeds)
        self._pairs += list(pairs)
        self._speeds += [(float(a), float(b)) for a, b in speeds]
        self._fit()

    def _predict_sides(self, sides: list[Pair]) -> np.ndarray:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):
            return self.model.predict(np.asarray([job_features(a, b) for a, b in sides]))

    def predict(self, pairs: Sequence[Pair]) -> np.ndarray:
        """Speeds ``[[first, second], ...]`` of each pair sharing a GPU (clipped to 0.05..1.5)."""
        if self.model is None:
            raise RuntimeError("co-location predictor is not fitted")
        if not len(pairs):
            return np.zeros((0, 2))
        sides, _ = _samples(pairs)
        p = np.clip(np.exp(self._predict_sides(sides)), 0.05, 1.5)
        n = len(pairs)
        return np.stack([p[:n], p[n:]], axis=1)

    def predict_one(self, a: SoloProfile, b: SoloProfile) -> tuple[float, float]:
        s = self.predict([(a, b)])[0]
        return float(s[0]), float(s[1])

    @classmethod
    def from_data(cls, colocation: str | None = None, solo: str | None = None, seed: int = 0,
                  **kw) -> "CoLocationPredictor":
        pairs, speeds, _ = lucid_pairs(colocation, solo)
        return cls(seed=seed, **kw).fit(pairs, speeds)


class HybridCoLocation(CoLocationPredictor):
    """Boosted trees plus collaborative-filtering biases (IASP's idea): the (log) residual
    of a job next to a partner is modelled as ``victim bias`` (per model and per
    job) + ``aggressor bias`` (per model and per job), ridge-shrunk towards 0 by
    ``shrink`` pseudo-samples and fitted on out-of-fold residuals.  Jobs never
    seen get no bias: the trees alone."""

    def __init__(self, seed: int = 0, iterations: int = 300, shrink: float = 3.0, inner_folds: int = 5) -> None:
        super().__init__(seed, iterations)
        self.shrink = shrink
        self.inner_folds = inner_folds
        self.bias: dict[tuple[str, str], float] = {}

    @staticmethod
    def _keys(a: SoloProfile, b: SoloProfile) -> tuple[tuple[str, str], ...]:
        return (("victim_model", a.model), ("victim_job", a.key), ("aggressor_model", b.model),
                ("aggressor_job", b.key))

    def _fit(self) -> None:
        super()._fit()
        sides, y = _samples(self._pairs, self._speeds)
        y = np.log(y)
        X = np.asarray([job_features(a, b) for a, b in sides])
        groups = [pair_group(a.model, b.model) for a, b in sides]
        oof = np.zeros(len(y))
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1):
            for tr, te in grouped_folds(groups, min(self.inner_folds, len(set(groups))), self.seed + 1):
                if len(te) == 0 or len(tr) == 0:
                    continue
                oof[te] = self._new().fit(X[tr], y[tr]).predict(X[te])
        resid = y - oof
        keys = [self._keys(a, b) for a, b in sides]
        w: dict[tuple[str, str], float] = {}
        for _ in range(10):  # coordinate descent over the four bias families
            for slot in range(4):
                num: dict[tuple[str, str], float] = {}
                den: dict[tuple[str, str], float] = {}
                for ks, r in zip(keys, resid):
                    rest = sum(w.get(k, 0.0) for j, k in enumerate(ks) if j != slot)
                    num[ks[slot]] = num.get(ks[slot], 0.0) + r - rest
                    den[ks[slot]] = den.get(ks[slot], 0.0) + 1.0
                for k in num:
                    w[k] = num[k] / (den[k] + self.shrink)
        self.bias = w

    def _predict_sides(self, sides: list[Pair]) -> np.ndarray:
        base = super()._predict_sides(sides)
        return base + np.asarray([sum(self.bias.get(k, 0.0) for k in self._keys(a, b)) for a, b in sides])


# ---------------------------------------------------------------- data and validation


def pair_group(m1: str, m2: str) -> tuple[str, str]:
    """The CV group of a row: the unordered pair of model names."""
    return (m1, m2) if m1 <= m2 else (m2, m1)


def lucid_pairs(colocation: str | None = None, solo: str | None = None
                ) -> tuple[list[Pair], list[tuple[float, float]], list[tuple[str, str]]]:
    """lucid/colocation.csv joined with lucid/solo.csv on (model, dataset, batch size, AMP):
    (pairs of solo profiles, their measured speeds, each row's model-pair group).  A row whose
    job has no solo profile is an error that names it."""
    from scheduler import data

    profiles = {}
    for r in data.lucid_solo(solo):
        profiles[(r["model"], r["dataset"], r["batchsize"], r["amp"])] = SoloProfile(
            r["gpu_util"], r["gmem_util"], r["gmem"], r["batchsize"], bool(r["amp"]), r["model"])
    pairs, speeds, groups = [], [], []
    for n, r in enumerate(data.lucid_colocation(colocation), start=2):
        ends = []
        for i in ("1", "2"):
            k = (r["model" + i], r["dataset" + i], r["batchsize" + i], r["amp" + i])
            if k not in profiles:
                raise ValueError(f"co-location row {n}: job {k} has no solo profile")
            ends.append(profiles[k])
        pairs.append((ends[0], ends[1]))
        speeds.append((r["speed1"], r["speed2"]))
        groups.append(pair_group(r["model1"], r["model2"]))
    return pairs, speeds, groups


def grouped_folds(groups: Sequence, k: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``k`` (train, test) index splits with every group wholly on one side: the
    distinct groups are shuffled with ``seed`` and dealt round-robin to folds."""
    uniq = sorted(set(groups))
    if not 2 <= k <= len(uniq):
        raise ValueError(f"grouped CV needs 2 <= folds <= {len(uniq)} groups, got {k}")
    order = np.random.default_rng(seed).permutation(len(uniq))
    fold_of = {uniq[j]: i % k for i, j in enumerate(order)}
    f = np.asarray([fold_of[g] for g in groups])
    return [(np.nonzero(f != i)[0], np.nonzero(f == i)[0]) for i in range(k)]


def _plain_forest(seed: int):
    from sklearn.ensemble import RandomForestRegressor

    return RandomForestRegressor(n_estimators=100, random_state=seed, n_jobs=1)


def cross_validate(pairs: Sequence[Pair], speeds: Sequence[tuple[float, float]], groups: Sequence,
                   folds: int = 5, seeds: Sequence[int] = (0,), hybrid: bool = True,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Grouped-by-pair CV of the per-job co-located speed: MAPE and MAE of the
    predictor, of the hybrid, of a plain random forest on the same profiles and of
    the constant (the training rows' median), averaged over ``seeds`` (each a
    different dealing of pairs to folds)."""
    sides, y = _samples(pairs, speeds)
    n = len(pairs)
    g = list(groups) + list(groups)  # each pair's two samples share its group
    Xp = np.asarray([plain_features(a, b) for a, b in sides])
    res: dict[str, list[float]] = {}

    def add(name: str, pred: np.ndarray) -> None:
        res.setdefault(f"{name}_mape", []).append(mape(y, pred))
        res.setdefault(f"{name}_mae", []).append(float(np.mean(np.abs(pred - y))))

    for seed in seeds:
        preds = {k: np.zeros_like(y) for k in ("gbrt", "hybrid", "forest", "constant")}
        for tr, te in grouped_folds(g, folds, seed):
            rows = sorted({i % n for i in tr})  # both samples of a training pair
            test_rows = sorted({i % n for i in te})
            assert not {g[i] for i in tr} & {g[i] for i in te}, "a pair leaked across folds"
            tp, ts = [pairs[i] for i in rows], [speeds[i] for i in rows]
            xp = [pairs[i] for i in test_rows]
            idx = np.asarray(test_rows)
            out = CoLocationPredictor(seed=seed).fit(tp, ts).predict(xp)
            preds["gbrt"][idx], preds["gbrt"][idx + n] = out[:, 0], out[:, 1]
            if hybrid:
                out = HybridCoLocation(seed=seed).fit(tp, ts).predict(xp)
                preds["hybrid"][idx], preds["hybrid"][idx + n] = out[:, 0], out[:, 1]
            forest = _plain_forest(seed).fit(Xp[tr], y[tr])
            preds["forest"][te] = forest.predict(Xp[te])
            preds["constant"][te] = float(np.median(y[tr]))
            if progress:
                progress(f"fold done (seed {seed})")
        for k, p in preds.items():
            if k != "hybrid" or hybrid:
                add(k, p)
    out = {k: float(np.mean(v)) for k, v in res.items()}
    out["gbrt_mape_range"] = [float(min(res["gbrt_mape"])), float(max(res["gbrt_mape"]))]
    out.update({"rows": n, "samples": int(len(y)), "pairs": len(set(groups)), "folds": folds,
                "seeds": list(seeds)})
    return out
