"""Solo profiles for Gavel's job types, from Lucid's measurements of the same model families.

The simulator's ground truth for pairs is Gavel's measured throughputs, but
Gavel published no per-job utilisation.  A live node would report each job's
utilisation while it runs alone; the simulator reports instead the solo
profile Lucid measured (lucid/solo.csv, Hu et al., ASPLOS'23) for the same
model family, at the nearest batch size (in log scale), without AMP:

=================  ===========================================
Gavel model        Lucid job (family)
=================  ===========================================
ResNet-18          ResNet18, CIFAR-10 (Gavel: CIFAR-10 too)
ResNet-50          ResNet50, ImageNet (Gavel: ImageNet too)
Transformer        Transformer, Multi30k (Gavel: Multi30k too)
LM                 LSTM, Wikitext2 (Gavel: LSTM on Wikitext-2)
Recommendation     NeuMF, MovieLens (Gavel: autoencoder on ML-20M)
CycleGAN           DCGAN, LSUN (both image GANs)
A3C                PPO, LunarLander (both small RL policies)
=================  ===========================================

Models outside the table have no profile (the predictors then fall back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FAMILIES = {"ResNet-18": "ResNet18", "ResNet-50": "ResNet50", "Transformer": "Transformer", "LM": "LSTM",
            "Recommendation": "NeuMF", "CycleGAN": "DCGAN", "A3C": "PPO"}


@dataclass(frozen=True)
class SoloTelemetry:
    """What a node would report for a job running alone."""

    sm_percent: float
    mem_percent: float
    gmem_mib: float


class GavelSoloProfiles:
    """``profile(model, batch_size) -> SoloTelemetry | None`` (see the module docstring)."""

    def __init__(self, solo_rows: list[dict]) -> None:
        self.rows: dict[str, list[dict]] = {}
        for r in solo_rows:
            if not r["amp"]:
                self.rows.setdefault(r["model"], []).append(r)
        self._cache: dict[tuple[str, int], SoloTelemetry | None] = {}

    @classmethod
    def from_data(cls, path: str | None = None) -> "GavelSoloProfiles":
        from scheduler import data

        return cls(data.lucid_solo(path))

    def profile(self, model: str, batch_size: int) -> SoloTelemetry | None:
        k = (model, batch_size)
        if k not in self._cache:
            rows = self.rows.get(FAMILIES.get(model, ""), [])
            if not rows:
                self._cache[k] = None
            else:
                bs = max(batch_size, 1)
                r = min(rows, key=lambda r: (abs(math.log(r["batchsize"] / bs)), r["batchsize"]))
                self._cache[k] = SoloTelemetry(r["gpu_util"], r["gmem_util"], r["gmem"])
        return self._cache[k]
