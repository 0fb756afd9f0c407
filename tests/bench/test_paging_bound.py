"""The arithmetic of ``dlshare bench paging-bound``: the workload's unit law, the cache models and the
floor on a step's time (the measured parts run only in the benchmark)."""

import numpy as np
import pytest

from bench.paging_bound import (a0_misses_per_step, floor_step_ms, gclock_misses_per_step, lfu_misses_per_step,
                                lru_misses_per_step, unit_probabilities)
from bench.paging_work import zipf_rows


def test_unit_law_is_the_one_the_workload_draws_from():
    rows, draws = 1 << 14, 400_000  # 1,024 units of 16 rows
    p = unit_probabilities(rows)
    assert p.shape == (1024,) and p.sum() == pytest.approx(1.0, abs=1e-12)
    seen = np.bincount(zipf_rows(np.random.default_rng(11), rows, draws) // 16, minlength=1024) / draws
    sigma = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(seen - p) <= 6 * sigma + 1e-9)
    assert p.max() > 20 * np.median(p)  # skewed, and the hash spreads the hot rows over units


def test_a0_for_a_uniform_law_misses_what_is_not_held():
    n, cap, lookups = 1000, 250, 40
    p = np.full(n, 1 / n)
    distinct, misses = a0_misses_per_step(p, cap, lookups)
    expected_distinct = n * (1 - (1 - 1 / n) ** lookups)
    assert distinct == pytest.approx(expected_distinct, rel=1e-9)
    assert misses == pytest.approx(distinct * (n - cap) / n, rel=1e-9)


def test_lru_on_a_uniform_law_hits_its_share_and_a0_beats_it_on_a_skewed_one():
    n, cap, lookups = 2000, 500, 64
    uniform = np.full(n, 1 / n)
    distinct, _ = a0_misses_per_step(uniform, cap, lookups)
    lru = lru_misses_per_step(uniform, cap, lookups, steps=300, warm=60)
    assert lru == pytest.approx(distinct * (1 - cap / n), rel=0.05)
    skewed = unit_probabilities(16 * n)[:n]
    skewed /= skewed.sum()
    _, a0 = a0_misses_per_step(skewed, cap, lookups)
    assert a0 < lru_misses_per_step(skewed, cap, lookups, steps=300, warm=60)


def test_replacement_policies_rank_as_theory_says_on_a_skewed_law():
    """On independent draws from a skewed law: A0 (knowing the law) <= LFU (learning it) <= GCLOCK
    (counting recent references) <= LRU; on a uniform law every policy hits its share."""
    n, cap, lookups = 2000, 500, 64
    skewed = unit_probabilities(16 * n)[:n]
    skewed /= skewed.sum()
    _, a0 = a0_misses_per_step(skewed, cap, lookups)
    lru = lru_misses_per_step(skewed, cap, lookups, steps=300, warm=60)
    gclock = gclock_misses_per_step(skewed, cap, lookups, steps=300, warm=60)
    lfu = lfu_misses_per_step(skewed, cap, lookups, steps=300, warm=60)
    assert a0 <= lfu * 1.02 and lfu < gclock < lru
    uniform = np.full(n, 1 / n)
    distinct, _ = a0_misses_per_step(uniform, cap, lookups)
    for sim in (gclock_misses_per_step, lfu_misses_per_step):
        assert sim(uniform, cap, lookups, steps=300, warm=60) == pytest.approx(distinct * (1 - cap / n), rel=0.05)


def test_a_step_is_bounded_by_its_compute_or_by_all_its_cpu_over_the_cpus():
    assert floor_step_ms(6.0, 6.0, 2.0, 2) == 6.0  # compute-bound: the data plane fits beside it
    assert floor_step_ms(6.0, 6.0, 14.0, 2) == 10.0  # CPU-bound
    assert floor_step_ms(6.0, 6.0, 14.0, 4) == 6.0


def test_metrics_give_each_stage_its_median_and_a_failed_share_prints_dashes(capsys):
    """The table from synthetic runs: the engine's stage times are medians over the rounds; a share
    whose runs all failed prints "-" instead of stopping the report."""
    from bench.paging_bound import ENGINE_STAGES, _metrics, _print

    def region(step: float, evict: float) -> dict:
        return {"step_ms": step, "program_cpu_ms": 1.5 * step, "donors_cpu_ms": 2.0, "fetched_per_step": 100.0,
                "written_per_step": 90.0, "samples_per_s": 1.0,
                **{f"{k}_ms_per_step": 1.0 for k in ENGINE_STAGES}, "evict_ms_per_step": evict}

    runs = {"local": [{"step_ms": 5.0, "program_cpu_ms": 5.0}, {"step_ms": 7.0, "program_cpu_ms": 7.0}],
            "region50": [region(20.0, 3.0), region(30.0, 9.0), region(25.0, 4.0)],
            "region25": [{"error": "the program died"}],
            "plane50": [{"program_cpu_ms": 4.0, "donors_cpu_ms": 2.0}]}
    m = _metrics(runs, 1 << 22, 2, quick=True)
    assert m["local50_engine_ms_per_step"]["evict"] == 4.0
    assert m["local50_engine_ms_per_step"]["fetch"] == 1.0
    assert m["local50_step_ms"] == 25.0 and m["dlrm_local50_vs_local"] == pytest.approx(6.0 / 25.0)
    assert m["local25_step_ms"] is None and m["local25_engine_ms_per_step"]["evict"] is None
    _print(m)
    out = capsys.readouterr().out
    assert "50%: engine threads' ms a step (summed over threads): fault 1.00, fetch 1.00" in out
    assert "evict 4.00" in out
    assert "25%: engine threads' ms a step (summed over threads): fault -," in out
