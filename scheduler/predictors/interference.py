"""Interference predictor: from the utilisation of a co-located set to its slowdown.

Input: for each job sharing a device, its SM% and memory-bandwidth% when it
runs alone.  Output: the set's interference (IADeep's ``sum_interference``:
the summed relative slowdown of its members).  The features do not depend on
which models are in the set, only on their utilisations, so a model never seen
in training is still predicted: counts, sums, maxima, minima and pairwise
products of SM% and mem%.

Trained on iadeep/colocation_util.csv (IADeep, RTX 3090 runs).  IADeep's own
random forest reached 27.8% MAPE on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.model_selection import KFold

Utilisation = tuple[float, float]  # (SM %, memory-bandwidth %) of one job alone


def set_features(members: Sequence[Utilisation]) -> list[float]:
    """Permutation-invariant features of a co-located set."""
    sm = np.array([m[0] for m in members], dtype=float)
    mem = np.array([m[1] for m in members], dtype=float)
    if len(sm) == 0:
        sm = mem = np.zeros(1)
    pair_sm = (sm.sum() ** 2 - (sm ** 2).sum()) / 2.0
    pair_mem = (mem.sum() ** 2 - (mem ** 2).sum()) / 2.0
    return [float(len(members)), sm.sum(), mem.sum(), sm.max(), mem.max(), sm.min(), mem.min(),
            pair_sm / 100.0, pair_mem / 100.0, (sm * mem).sum() / 100.0]


def rows_to_sets(models: Sequence[str], X: np.ndarray) -> list[list[Utilisation]]:
    """Turn colocation_util.csv rows (``m_sm`` block, then ``m_mem`` block) into sets."""
    k = len(models)
    out = []
    for row in X:
        out.append([(row[i], row[k + i]) for i in range(k) if row[i] > 0 or row[k + i] > 0])
    return out


def mape(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    y_true = np.asarray(y_true, dtype=float)
    return float(np.mean(np.abs(y_pred - y_true) / np.maximum(np.abs(y_true), 1e-9)))


class InterferencePredictor:
    """``fit(sets, y)``, ``predict(sets)``, ``update(sets, y)`` (online samples
    from telemetry: appended and refitted).

    Gradient-boosted trees with absolute loss weighted by 1/y: that makes each
    leaf a weighted median, the constant that minimises relative (MAPE) error.
    """

    def __init__(self, seed: int = 0, n_estimators: int = 200) -> None:
        self.seed = seed
        self.n_estimators = n_estimators
        self._X: list[list[float]] = []
        self._y: list[float] = []
        self.model: GradientBoostingRegressor | None = None

    def _new(self) -> GradientBoostingRegressor:
        return GradientBoostingRegressor(loss="absolute_error", n_estimators=self.n_estimators, max_depth=2,
                                         learning_rate=0.1, random_state=self.seed)

    def _fit(self) -> None:
        y = np.asarray(self._y)
        self.model = self._new().fit(np.asarray(self._X), y, sample_weight=1.0 / y)

    def fit(self, sets: Sequence[Sequence[Utilisation]], y: Sequence[float]) -> "InterferencePredictor":
        if len(sets) != len(y) or not len(y):
            raise ValueError("fit needs as many targets as sets, and at least one")
        y = np.asarray(y, dtype=float)
        if np.any(y <= 0):
            raise ValueError("interference targets must be > 0")
        self._X = [set_features(s) for s in sets]
        self._y = list(y)
        self._fit()
        return self

    def predict(self, sets: Sequence[Sequence[Utilisation]]) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("predictor is not fitted")
        return np.maximum(self.model.predict(np.asarray([set_features(s) for s in sets])), 1e-6)

    def update(self, sets: Sequence[Sequence[Utilisation]], y: Sequence[float]) -> None:
        self._X += [set_features(s) for s in sets]
        if any(v <= 0 for v in y):
            raise ValueError("interference targets must be > 0")
        self._y += [float(v) for v in y]
        self._fit()

    @classmethod
    def from_data(cls, path: str | None = None, seed: int = 0) -> "InterferencePredictor":
        from scheduler import data

        models, X, y = data.colocation_util(path)
        return cls(seed=seed).fit(rows_to_sets(models, X), y)


def weighted_median(values: np.ndarray) -> float:
    """The constant with the least mean relative error over ``values`` (> 0)."""
    v = np.sort(np.asarray(values, dtype=float))
    c = np.cumsum(1.0 / v)
    return float(v[np.searchsorted(c, c[-1] / 2.0)])


def mape_floor(sets: Sequence[Sequence[Utilisation]], y: Sequence[float]) -> float:
    """The least MAPE any function of the inputs can reach on these rows, in
    sample: rows with identical inputs but different targets bound it."""
    groups: dict[tuple, list[float]] = {}
    for s, t in zip(sets, y):
        groups.setdefault(tuple(sorted(s)), []).append(float(t))
    best = {k: weighted_median(np.asarray(v)) for k, v in groups.items()}
    return float(np.mean([abs(best[tuple(sorted(s))] - t) / t for s, t in zip(sets, y)]))


def cross_validate(sets: Sequence[Sequence[Utilisation]], y: Sequence[float], folds: int = 5,
                   seed: int = 0, repeats: int = 1) -> dict[str, float]:
    """K-fold MAPE and MAE of the predictor (averaged over ``repeats`` shuffles
    of the folds), of a naive baseline (the training rows' MAPE-optimal
    constant), and the in-sample floor, so the number can be judged."""
    y = np.asarray(y, dtype=float)
    res: dict[str, list[float]] = {"mape": [], "mae": [], "naive_mape": [], "naive_mae": []}
    for r in range(repeats):
        pred = np.zeros_like(y)
        naive = np.zeros_like(y)
        for tr, te in KFold(folds, shuffle=True, random_state=seed + r).split(y):
            p = InterferencePredictor(seed=seed).fit([sets[i] for i in tr], y[tr])
            pred[te] = p.predict([sets[i] for i in te])
            naive[te] = weighted_median(y[tr])
        res["mape"].append(mape(y, pred))
        res["mae"].append(float(np.mean(np.abs(pred - y))))
        res["naive_mape"].append(mape(y, naive))
        res["naive_mae"].append(float(np.mean(np.abs(naive - y))))
    out = {k: float(np.mean(v)) for k, v in res.items()}
    out["mape_min"], out["mape_max"] = float(min(res["mape"])), float(max(res["mape"]))
    out.update({"floor_mape": mape_floor(sets, y), "n": int(len(y)), "repeats": repeats, "folds": folds})
    return out
