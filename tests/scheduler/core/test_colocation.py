"""The co-location predictor on Lucid's runs: grouped CV that cannot leak a pair, baselines, update()."""

import numpy as np
import pytest

from scheduler import Job, data
from scheduler.predictors import Predictors
from scheduler.predictors.colocation import (
    CoLocationPredictor, HybridCoLocation, SoloProfile, cross_validate, grouped_folds, job_features, lucid_pairs,
    mape, pair_group,
)


@pytest.fixture(scope="module")
def lucid():
    return lucid_pairs()


def test_lucid_join_gives_every_row_two_profiles(lucid):
    pairs, speeds, groups = lucid
    assert len(pairs) == len(speeds) == len(groups) == 1061
    assert len(set(groups)) == 42  # the model pairs of lucid/colocation.csv
    a, b = pairs[0]
    assert a.model == "MobileNetV3" and b.model == "ResNet18" and a.batch_size == 32
    assert groups[0] == pair_group("ResNet18", "MobileNetV3")  # unordered


def test_grouped_folds_never_split_a_group():
    groups = [("a", "b")] * 5 + [("a", "c")] * 3 + [("b", "c")] * 4 + [("c", "c")] * 2 + [("d", "d")] * 6
    seen_test = []
    for seed in range(5):
        folds = grouped_folds(groups, 3, seed)
        tested = np.concatenate([te for _, te in folds])
        assert sorted(tested) == list(range(len(groups)))  # every row tested exactly once
        for tr, te in folds:
            assert not {groups[i] for i in tr} & {groups[i] for i in te}
            seen_test.append(frozenset(groups[i] for i in te))
    assert len(set(seen_test)) > 3  # the seed deals the groups differently
    with pytest.raises(ValueError):
        grouped_folds(groups, 6, 0)  # more folds than groups


def test_cv_on_lucid_beats_the_constant_and_the_plain_forest(lucid):
    pairs, speeds, groups = lucid
    cv = cross_validate(pairs, speeds, groups, folds=5, seeds=(0,), hybrid=False)
    assert cv["samples"] == 2122 and cv["pairs"] == 42
    assert cv["gbrt_mape"] < cv["forest_mape"] < cv["constant_mape"]
    assert cv["gbrt_mape"] < 0.06 and cv["constant_mape"] > 0.09


def test_a_random_split_leaks_and_looks_rosier(lucid):
    """The reason the CV is grouped: with rows of the same pair on both sides, the error drops."""
    pairs, speeds, groups = lucid
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(pairs))
    test, train = idx[:200], idx[200:]
    m = CoLocationPredictor().fit([pairs[i] for i in train], [speeds[i] for i in train])
    random_err = mape(np.ravel([speeds[i] for i in test]), m.predict([pairs[i] for i in test]).ravel())
    held = {g for g in sorted(set(groups))[::5]}
    tr = [i for i, g in enumerate(groups) if g not in held]
    te = [i for i, g in enumerate(groups) if g in held]
    m2 = CoLocationPredictor().fit([pairs[i] for i in tr], [speeds[i] for i in tr])
    grouped_err = mape(np.ravel([speeds[i] for i in te]), m2.predict([pairs[i] for i in te]).ravel())
    assert random_err < grouped_err


def test_predictor_learns_a_clean_interference_law_and_updates():
    rng = np.random.default_rng(3)

    def law(a, b):
        u = a.gpu_util + b.gpu_util
        return min(1.0, 100.0 / u) ** 0.8 if u > 0 else 1.0

    def prof():
        return SoloProfile(float(rng.uniform(5, 100)), float(rng.uniform(1, 60)), float(rng.uniform(1000, 9000)),
                           int(rng.choice([32, 64, 128])), bool(rng.integers(0, 2)))

    pairs = [(prof(), prof()) for _ in range(500)]
    speeds = [(law(a, b), law(b, a)) for a, b in pairs]
    m = CoLocationPredictor().fit(pairs[:300], speeds[:300])
    err = mape(np.ravel(speeds[300:]), m.predict(pairs[300:]).ravel())
    assert err < 0.05
    m.update(pairs[300:450], speeds[300:450])
    assert mape(np.ravel(speeds[450:]), m.predict(pairs[450:]).ravel()) < err * 1.2
    assert len(m._pairs) == 450
    with pytest.raises(ValueError):
        m.update(pairs[:2], [(1.0, -1.0), (1.0, 1.0)])
    with pytest.raises(RuntimeError):
        CoLocationPredictor().predict(pairs[:1])


def test_unknown_footprint_is_predicted_not_refused(lucid):
    pairs, speeds, _ = lucid
    m = CoLocationPredictor().fit(pairs[:400], speeds[:400])
    a, b = pairs[500]
    blind = SoloProfile(a.gpu_util, a.gmem_util, float("nan"), a.batch_size, a.amp)
    s = m.predict_one(blind, b)
    assert all(0.05 <= x <= 1.5 for x in s)
    assert len(job_features(blind, b)) == len(job_features(a, b))


def test_hybrid_biases_come_from_the_job_x_job_matrix(lucid):
    pairs, speeds, _ = lucid
    h = HybridCoLocation(iterations=50).fit(pairs, speeds)
    assert any(k[0] == "victim_model" for k in h.bias) and any(k[0] == "aggressor_job" for k in h.bias)
    stranger = SoloProfile(50.0, 20.0, 3000.0, 64, False, "NeverSeen")
    base = CoLocationPredictor(iterations=50).fit(pairs, speeds)
    # a job never seen gets no bias: the trees alone decide its side
    assert h.predict_one(stranger, stranger) == pytest.approx(base.predict_one(stranger, stranger))


def test_bundle_prefers_measured_pairs_then_the_predictor_and_updates_from_telemetry():
    from scheduler.events import JobSample

    p = Predictors(colocation=CoLocationPredictor(iterations=50).fit(*lucid_pairs()[:2]), update_every=1)
    a, b = Job("a", "ResNet18", 64), Job("b", "VGG", 64)
    p.observe(a.job_type, (), JobSample(sm_percent=80.7, mem_percent=47.0))
    p.observe(b.job_type, (), JobSample(sm_percent=51.0, mem_percent=30.0))
    predicted = p.colocated_speeds(a.job_type, [b.job_type], a, [b])
    assert predicted == pytest.approx(list(p.colocation.predict_one(p.solo_profile(a), p.solo_profile(b))))
    n = len(p.colocation._pairs)
    p.observe(a.job_type, (b.job_type,), JobSample(speed=0.4))
    p.observe(b.job_type, (a.job_type,), JobSample(speed=0.5))
    assert len(p.colocation._pairs) == n + 1  # the measured pair became a training row
    assert p.colocated_speeds(a.job_type, [b.job_type], a, [b]) == pytest.approx([0.4, 0.5])  # measured wins


def test_lucid_loaders_name_the_bad_row(tmp_path):
    bad = tmp_path / "c.csv"
    src = data.path("lucid/colocation.csv").read_text().splitlines()
    bad.write_text("\n".join([src[0], src[1], src[2].replace(",0.97,", ",-1,", 1)]) + "\n")
    with pytest.raises(ValueError, match="row 3"):
        data.lucid_colocation(bad)
    bad.write_text("model1,speed1\nA,1\n")
    with pytest.raises(ValueError, match="missing columns"):
        data.lucid_colocation(bad)


def test_bundle_asks_the_model_once_per_pair_of_profiles_even_with_unknown_footprints(lucid):
    from scheduler.events import JobSample

    pairs, speeds, _ = lucid
    model = CoLocationPredictor(iterations=30).fit(pairs[:300], speeds[:300])
    calls = []
    real = model.predict_one
    model.predict_one = lambda a, b: calls.append(1) or real(a, b)
    p = Predictors(colocation=model)
    a, b = Job("a", "X", 32), Job("b", "Y", 64)  # no declared GPU memory: NaN in the profile
    p.observe(a.job_type, (), JobSample(sm_percent=40.0, mem_percent=10.0))
    p.observe(b.job_type, (), JobSample(sm_percent=70.0, mem_percent=30.0))
    first = p.colocated_speeds(a.job_type, [b.job_type], a, [b])
    assert p.colocated_speeds(a.job_type, [b.job_type], a, [b]) == first
    assert len(calls) == 1
