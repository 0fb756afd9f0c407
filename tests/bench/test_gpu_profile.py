"""bench/gpu_profile.py without a GPU: the plan, features, NVML sampling through a fake, CSV rows."""

import csv
from types import SimpleNamespace

import pytest

from bench import gpu_profile as gp
from nodesvc.bus.procs import wait_until
from scheduler.predictors.utilisation import UtilisationPredictor


class FakeNvml:
    def __init__(self):
        self.k = 0

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        self.k += 1
        return SimpleNamespace(gpu=40 + self.k % 3, memory=20)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=1 << 30)


def test_plan_has_singles_then_pairs():
    p = gp.plan(["a", "b"], [16, 32])
    assert p[:4] == [(("a", 16),), (("a", 32),), (("b", 16),), (("b", 32),)]
    assert len(p) == 4 + 6 and all(len(g) == 2 for g in p[4:])


def test_sampler_and_summary_with_fake_nvml():
    s = gp.NvmlSampler(FakeNvml(), period_s=0.001)
    with s:
        wait_until(lambda: len(s.samples) > 5, timeout=30, what="six samples")
    sm, mem, used = gp.summarise(s.samples, skip=2)
    assert 40 <= sm <= 42 and mem == 20 and used == 1 << 30
    with pytest.raises(ValueError):
        gp.summarise([])


def test_rows_round_trip_into_the_utilisation_predictor(tmp_path):
    spec = next(m for m in gp.zoo() if m.name == "mlp_recommender")
    feats = gp.feature_rows([spec], [8, 16])
    rows = []
    for (m, b), f in feats.items():
        rows.append({"model": m, "batch_size": b, **f, "sm_percent": 10.0 * b, "mem_percent": b,
                     "memory_used_bytes": 1, "steps_per_s": 5.0})
    rows.append({**rows[0], "partner": "x", "partner_batch_size": 8})
    path = tmp_path / "rows.csv"
    gp.write_rows(str(path), rows)
    assert list(csv.DictReader(open(path)))[0]["model"] == "mlp_recommender"
    p = UtilisationPredictor.from_rows(str(path))
    assert len(p._y) == 2  # pair rows are not "alone" rows
