"""The batch-size tuner: GP-UCB finds the best combination of a pair's batch sizes."""

import numpy as np
import pytest

from scheduler import Job
from scheduler.plugins.tuner import BatchSizeTuner, arms_for, tuner_for


def _run(table, default, rounds, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    t = BatchSizeTuner(sorted(table), default)
    played = []
    for _ in range(rounds):
        a = t.next()
        played.append(a)
        t.observe(a, table[a] * (1.0 + noise * rng.standard_normal()))
    return t, played


def test_first_round_plays_the_default_then_finds_the_best():
    sizes = (16, 32, 64, 128, 256)
    # combined samples/s peaks at (64, 128), smooth in log batch size
    table = {(a, b): 1000.0 * np.exp(-0.5 * ((np.log2(a) - 6) ** 2 + (np.log2(b) - 7) ** 2) / 1.5)
             for a, b in arms_for(sizes, sizes)}
    t, played = _run(table, (16, 16), rounds=12, noise=0.03)
    assert played[0] == (16, 16)
    assert t.best() == (64, 128)
    assert len(set(played)) < len(table)  # it did not have to try every arm


def test_noisy_rewards_do_not_fool_it_for_long():
    table = {(32, 32): 100.0, (32, 64): 104.0, (64, 32): 150.0, (64, 64): 110.0}
    wins = 0
    for seed in range(10):
        t, _ = _run(table, (32, 32), rounds=15, noise=0.05, seed=seed)
        wins += t.best() == (64, 32)
    assert wins >= 8


def test_tuner_for_jobs_uses_declared_ranges_only():
    fixed_a, fixed_b = Job("a", "m", 32), Job("b", "n", 64)
    assert tuner_for(fixed_a, fixed_b) is None  # nobody declared a range: nothing to tune
    a = Job("a", "m", 64, batch_sizes=(32, 64, 128))
    t = tuner_for(a, fixed_b)
    assert t.arms == [(32, 64), (64, 64), (128, 64)] and t.next() == (64, 64)
    assert Job.from_dict(a.to_dict()).batch_sizes == (32, 64, 128)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        BatchSizeTuner([(32, 32)], (64, 64))
    with pytest.raises(ValueError):
        BatchSizeTuner([(32, 32), (32, 32)], (32, 32))
    t = BatchSizeTuner([(32, 32), (64, 64)], (32, 32))
    with pytest.raises(ValueError):
        t.observe((16, 16), 1.0)
    with pytest.raises(ValueError):
        t.observe((32, 32), float("nan"))
    with pytest.raises(ValueError):
        Job("j", "m", 32, batch_sizes=(0,))


def test_replay_on_lucid_beats_the_default_and_nears_the_best():
    from bench.tuner import evaluate

    r = evaluate(rounds=10, seeds=(0,))
    assert r["groups"] > 100 and r["arms_per_group"] >= 3
    assert r["gain_vs_default"] > 1.2  # Lucid's batch sizes matter: the default is often far off
    assert r["of_best"] > 0.95
    assert r["regret"] < r["regret_default"]
