"""Batch-size tuning for a co-located pair (IADeep's idea), by GP-UCB.

Two jobs share a GPU; each may declare the batch sizes it accepts
(``Job.batch_sizes``).  The tuner picks, round after round, the pair of batch
sizes to run next and learns from the combined samples/s the pair reports,
so that it settles on the combination with the highest combined throughput.
A job that declared no range keeps its batch size.

The learner is GP-UCB (Srinivas, Krause, Kakade and Seeger, ICML 2010): a
Gaussian process over (log2 batch size of each job) with a squared-exponential
kernel, and the arm with the highest ``mean + sqrt(beta_t) * sd`` is played.
Knobs, set a priori:

* rewards are the combined samples/s relative to the best seen so far; the
  prior mean of an untried combination is the mean of those seen, with
  standard deviation 0.5 (it may be half again better, or half as good);
* length scale 1.0 in log2 batch size: throughput changes smoothly across one
  doubling of the batch, and may change shape over two;
* noise standard deviation 0.05: run-to-run variation of a measured speed
  (Lucid's repeated configurations vary by a few percent);
* ``beta_t = 2 ln(|arms| t^2 pi^2 / (6 delta))``, ``delta = 0.1``: the paper's
  schedule for a finite arm set (its Theorem 1).

Pure: no clock, no randomness (ties go to the first arm in order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Arm = tuple[int, int]


class BatchSizeTuner:
    """``next() -> arm``, ``observe(arm, samples_per_s)``, ``best() -> arm``."""

    def __init__(self, arms: Sequence[Arm], default: Arm, *, length_scale: float = 1.0, noise: float = 0.05,
                 delta: float = 0.1) -> None:
        self.arms = [tuple(int(b) for b in a) for a in arms]
        if not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError("the tuner needs distinct arms")
        if tuple(default) not in self.arms:
            raise ValueError(f"default {default} is not among the arms")
        if any(b <= 0 for a in self.arms for b in a):
            raise ValueError("batch sizes must be > 0")
        if not length_scale > 0 or not noise > 0 or not 0 < delta < 1:
            raise ValueError("length_scale and noise must be > 0, 0 < delta < 1")
        self.default = tuple(default)
        self.length_scale, self.noise, self.delta = float(length_scale), float(noise), float(delta)
        self._x = np.log2(np.asarray(self.arms, dtype=float))
        self._played: list[int] = []
        self._reward: list[float] = []  # samples/s, as reported

    AMPLITUDE = 0.5  # prior standard deviation, in units of the best throughput seen

    def _k(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return self.AMPLITUDE ** 2 * np.exp(-0.5 * d / self.length_scale ** 2)

    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of every arm's reward, relative to the best seen."""
        if not self._played:
            return np.ones(len(self.arms)), np.full(len(self.arms), self.AMPLITUDE)
        xs = self._x[self._played]
        raw = np.asarray(self._reward)
        y = raw / raw.max() if raw.max() > 0 else raw
        prior = float(y.mean())
        K = self._k(xs, xs) + self.noise ** 2 * np.eye(len(xs))
        Ks = self._k(self._x, xs)
        L = np.linalg.cholesky(K)
        alpha = np.linalg.solve(L.T, np.linalg.solve(L, y - prior))
        mean = prior + Ks @ alpha
        v = np.linalg.solve(L, Ks.T)
        var = np.maximum(self.AMPLITUDE ** 2 - (v ** 2).sum(0), 1e-12)
        return mean, np.sqrt(var)

    def next(self) -> Arm:
        """The arm to run in the next round (the default first)."""
        if not self._played:
            return self.default
        t = len(self._played) + 1
        beta = 2.0 * math.log(len(self.arms) * t * t * math.pi ** 2 / (6.0 * self.delta))
        mean, sd = self.posterior()
        return self.arms[int(np.argmax(mean + math.sqrt(beta) * sd))]

    def observe(self, arm: Arm, samples_per_s: float) -> None:
        """The pair ran ``arm`` for a round and reported ``samples_per_s`` combined."""
        arm = tuple(arm)
        if arm not in self.arms:
            raise ValueError(f"unknown arm {arm}")
        if not samples_per_s >= 0 or not math.isfinite(samples_per_s):
            raise ValueError("throughput must be finite and >= 0")
        self._played.append(self.arms.index(arm))
        self._reward.append(float(samples_per_s))

    def best(self) -> Arm:
        """The arm with the highest posterior mean among those played (what to keep running)."""
        if not self._played:
            return self.default
        mean, _ = self.posterior()
        tried = sorted(set(self._played))
        return self.arms[max(tried, key=lambda i: (mean[i], -i))]


def arms_for(sizes_a: Sequence[int], sizes_b: Sequence[int]) -> list[Arm]:
    """Every combination of the two jobs' allowed batch sizes."""
    return [(a, b) for a in sorted(set(sizes_a)) for b in sorted(set(sizes_b))]


def tuner_for(job_a, job_b) -> BatchSizeTuner | None:
    """A tuner for two co-located :class:`~scheduler.model.Job` s, or ``None`` when
    neither declared a batch-size range.  A job without a range keeps its batch size."""
    sa = tuple(job_a.batch_sizes) or (job_a.batch_size,)
    sb = tuple(job_b.batch_sizes) or (job_b.batch_size,)
    if len(sa) == 1 and len(sb) == 1:
        return None
    default = (job_a.batch_size if job_a.batch_size in sa else sa[0], job_b.batch_size if job_b.batch_size in sb else sb[0])
    return BatchSizeTuner(arms_for(sa, sb), default)
