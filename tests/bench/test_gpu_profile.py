"""bench/gpu_profile.py without a GPU: the plan, features, NVML sampling through a fake, CSV rows."""

import csv
import time
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
    same = gp.plan(["a", "b"], [16, 32], pairs="same")
    assert same[4:] == [(("a", 16), ("b", 16)), (("a", 32), ("b", 32))]
    singles = [(("a", 16),), (("b", 16),)]
    assert gp.plan(["a", "b"], [16], pairs="none") == gp.plan(["a", "b"], [16], pairs=False) == singles


def test_sampler_and_summary_with_fake_nvml():
    s = gp.NvmlSampler(FakeNvml(), period_s=0.001)
    with s:
        wait_until(lambda: len(s.samples) > 5, timeout=30, what="six samples")
    sm, mem, used = gp.summarise(s.samples)
    assert 40 <= sm <= 42 and mem == 20 and used == 1 << 30
    # only the samples inside the timed window count
    samples = [(1.0, 0.0, 0.0, 5.0), (2.0, 90.0, 30.0, 7.0), (3.0, 80.0, 40.0, 6.0), (4.0, 0.0, 0.0, 9.0)]
    assert gp.summarise(samples, 2.0, 3.0) == (85.0, 35.0, 7.0)
    with pytest.raises(ValueError):
        gp.summarise([])
    with pytest.raises(ValueError):
        gp.summarise(samples, 5.0, 6.0)


def test_a_pair_is_timed_together_and_a_failed_job_fails_its_group():
    """The whole measuring path on the CPU: two training processes, warmed up, then timed over one
    window; the samples of that window are summarised.  A job that cannot start fails the group with
    its reason, and its partner does not wait for it."""
    group = (("mlp_recommender", 4), ("transformer", 2))
    rates, (sm, mem, used) = gp.run_group(group, 0.5, FakeNvml(), device="cpu", period_s=0.01)
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert 40 <= sm <= 42 and mem == 20 and used == 1 << 30
    with pytest.raises(RuntimeError, match="no_such_model"):
        gp.run_group((("mlp_recommender", 4), ("no_such_model", 4)), 0.5, FakeNvml(), device="cpu")


def _dies(name, batch, seconds, q, start, device):
    """A job whose process dies without a word (as one killed for memory does)."""
    import os

    os._exit(3)


def test_a_job_whose_process_dies_fails_its_group_at_once():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ended with 3 and no result"):
        gp.run_group((("mlp_recommender", 4),), 0.5, FakeNvml(), device="cpu", target=_dies)
    assert time.monotonic() - t0 < 600  # not the 900 s deadline


class ConstantPredictor:
    def __init__(self, speeds):
        self.speeds = speeds

    def predict_one(self, a, b):
        return self.speeds


def _row(model, batch, partner="", pbatch="", sm=50.0, speed=""):
    return {"model": model, "batch_size": str(float(batch)), "partner": partner, "partner_batch_size": pbatch,
            "sm_percent": sm, "mem_percent": 10.0, "memory_used_bytes": 2.0 * 2**30, "steps_per_s": 1.0,
            "speed_vs_alone": speed}


def test_evaluate_holds_the_predictor_against_measured_pairs():
    rows = [_row("a", 16, sm=30.0), _row("b", 16, sm=40.0),
            _row("a", 16, "b", 16, speed=0.8), _row("b", 16, "a", 16, speed=0.6)]
    solo = gp.solo_profiles(rows)
    assert solo[("a", 16)].gpu_util == 30.0 and solo[("b", 16)].gmem_mib == pytest.approx(2048.0)
    assert gp.measured_pairs(rows) == [(("a", 16), ("b", 16), 0.8, 0.6)]
    # measured 0.8 + 0.6 = 1.4: admitted either way round; predicted 0.4 + 0.4: refused both ways
    res = gp.evaluate(rows, ConstantPredictor((0.4, 0.4)))
    assert res["mape"] == pytest.approx((0.4 / 0.8 + 0.2 / 0.6) / 2)
    assert (res["decisions"], res["agree"], res["false_admit"], res["false_reject"]) == (2, 0, 0, 2)
    # a resident that would keep less than half its speed refuses the newcomer, even if the sum gains:
    # a (at 1.0) may join b, which keeps 0.3, only if b is not the one already there
    res = gp.evaluate(rows, ConstantPredictor((1.0, 0.3)))
    assert res["pairs"][0]["predicted_admit"] == (True, False)  # (b joins a, a joins b)


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
