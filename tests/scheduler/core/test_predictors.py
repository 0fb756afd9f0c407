"""Predictors: each must beat a naive baseline, and can fail."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from scheduler import data
from scheduler.predictors.interference import (
    InterferencePredictor, cross_validate, mape, mape_floor, rows_to_sets, set_features,
)
from scheduler.predictors.sensitivity import SensitivityModel
from scheduler.predictors.utilisation import UtilisationPredictor, graph_features


def test_set_features_ignore_order():
    a = set_features([(50, 20), (10, 5)])
    assert a == set_features([(10, 5), (50, 20)])
    assert a[0] == 2 and a[1] == 60


def test_interference_cv_on_iadeep_beats_naive_but_not_the_floor():
    models, X, y = data.colocation_util()
    sets = rows_to_sets(models, X)
    cv = cross_validate(sets, y, folds=5)
    assert cv["n"] == 105
    assert cv["mape"] < cv["naive_mape"]  # better than the best constant
    assert 0.2 < mape_floor(sets, y) < 0.5  # identical inputs, different targets: no model gets below this


def test_interference_learns_a_clean_function_and_updates():
    rng = np.random.default_rng(0)
    sets = [[(rng.uniform(5, 90), rng.uniform(1, 40)) for _ in range(rng.integers(1, 4))] for _ in range(400)]
    truth = np.array([0.05 + sum(s for s, _ in st) * sum(m for _, m in st) / 2000.0 for st in sets])
    p = InterferencePredictor().fit(sets[:300], truth[:300])
    err = mape(truth[300:], p.predict(sets[300:]))
    naive = mape(truth[300:], np.full(100, np.median(truth[:300])))
    assert err < 0.25 and err < naive / 2
    p.update(sets[300:], truth[300:])
    assert mape(truth[300:], p.predict(sets[300:])) < err
    with pytest.raises(ValueError):
        p.fit(sets[:2], [1.0, -1.0])


def test_graph_features_count_linear_and_conv_flops():
    f = graph_features(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16))
    assert f["flops"] == 2 * 8 * (16 * 32 + 32 * 4)
    assert f["params"] == 16 * 32 + 32 + 32 * 4 + 4
    assert f["mix_linear"] == pytest.approx(2 / 3) and f["batch_size"] == 8
    g = graph_features(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)), torch.randn(2, 3, 10, 10))
    assert g["flops"] == 2 * (2 * 8 * 10 * 10) * 3 * 9
    assert g["activation_bytes"] >= 2 * 8 * 10 * 10 * 4


def test_utilisation_predictor_beats_mean_on_a_learnable_relation():
    rng = np.random.default_rng(1)
    feats, utils = [], []
    for _ in range(200):
        fl, bs = 10 ** rng.uniform(8, 12), float(rng.choice([16, 32, 64, 128]))
        f = {"flops": fl * bs, "params": 1e6, "activation_bytes": 1e7 * bs, "batch_size": bs, "mix_conv": rng.uniform()}
        sm = min(100.0, 8.0 * np.log10(fl * bs) - 40.0)
        feats.append(f)
        utils.append((sm, sm / 2))
    p = UtilisationPredictor().fit(feats[:150], utils[:150])
    pred = p.predict(feats[150:])
    true = np.array(utils[150:])
    err = np.abs(pred - true).mean()
    naive = np.abs(true - np.array(utils[:150]).mean(0)).mean()
    assert err < naive / 3
    assert len(p.predict_one(feats[0])) == 2
    with pytest.raises(RuntimeError):
        UtilisationPredictor().predict_one(feats[0])


def test_sensitivity_tables():
    s = SensitivityModel.from_data()
    assert s.speed("alexnet", 1, 3, 62.5e9) == pytest.approx(1.0)  # the proportional share is the unit
    assert s.speed("alexnet", 1, 12, 125e9) > 2.5  # CPU-hungry
    assert s.speed("gnmt", 1, 1, 20.83e9) == pytest.approx(1.0)  # insensitive
    c, m = s.fair_minimum("gnmt", 1, 3, 62.5e9)
    assert c < 3 and m < 62.5e9
    assert not s.knows("ResNet-18", 1)
    s.add_profile("mine", 1, [[0.5, 1.0]] * 9)
    assert s.speed("mine", 1, 24, 70e9) == 1.0


def test_predictor_bundle_falls_back_on_the_trained_interference_model():
    from scheduler import Job
    from scheduler.predictors import Predictors

    p = Predictors.from_data()
    a, b = Job("a", "X"), Job("b", "Y")
    p.alone_util.update({"X": (53.4, 26.7), "Y": (60.8, 34.7)})  # vgg16 and vgg19 alone (IADeep)
    speeds = p.colocated_speeds("X", ["Y"], a, [b])
    assert len(speeds) == 2 and all(0 < s < 1 for s in speeds)
    assert p.colocated_speeds("X", ["Y"], a, [b]) == speeds  # memoised, same answer
    # measured speeds, once reported, win over the model
    p.pairs.observe("X", ("Y",), 0.9)
    assert p.colocated_speeds("X", ["Y"], a, [b])[0] == pytest.approx(0.9)
