"""The paging bench's program (bench/paging_work.py): how a kill run times its rebuild."""

from __future__ import annotations

import threading

from bench.paging_work import _time_rebuild


class _Region:
    """A region whose health a test sets: healthy, then short of a copy, then healthy again."""

    def __init__(self) -> None:
        self.ok = True
        self.polled = threading.Event()

    def healthy(self) -> bool:
        self.polled.set()
        return self.ok


def test_the_rebuild_is_timed_from_the_kill_until_the_region_is_healthy_again():
    region = _Region()
    out = _time_rebuild(region)
    assert region.polled.wait(10)
    region.ok = False  # the loss is seen
    region.polled.clear()
    assert region.polled.wait(10)
    region.polled.clear()
    assert region.polled.wait(10)  # polled while short of a copy: not done yet
    assert "s" not in out
    region.ok = True  # rebuilt
    out["thread"].join(10)
    assert not out["thread"].is_alive() and out["s"] > 0


def test_a_loss_never_seen_gives_no_figure():
    out = _time_rebuild(_Region(), deadline_s=0.2)
    out["thread"].join(10)
    assert not out["thread"].is_alive() and "s" not in out


def test_the_kill_slowdown_pairs_each_kill_run_with_the_run_just_before_it():
    from bench.paging import kill_slowdowns

    runs = {
        # the round's region50 ran minutes before the pair: it is not the kill run's baseline
        "dlrm_region50": [{"round": 0, "samples_per_s": 400.0}, {"round": 1, "samples_per_s": 400.0}],
        "dlrm_region50_nokill": [{"round": 0, "samples_per_s": 100.0}, {"round": 1, "samples_per_s": 90.0}],
        "dlrm_region50_kill": [{"round": 0, "samples_per_s": 80.0}, {"round": 1, "error": "lost"},
                               {"round": 2, "samples_per_s": 50.0}],  # round 2 has no run without
    }
    assert kill_slowdowns(runs) == [1.25, None, None]


def test_the_kill_runs_extra_cpu_is_taken_against_the_run_just_before_it():
    from bench.paging import kill_extra_cpu

    runs = {
        "dlrm_region50_nokill": [{"round": 0, "program_cpu_s": 1.0, "donors_cpu_s": 2.0},
                                 {"round": 1, "program_cpu_s": 1.5}],
        "dlrm_region50_kill": [{"round": 0, "program_cpu_s": 1.25, "donors_cpu_s": 2.5},
                               {"round": 1, "program_cpu_s": 1.5}, {"round": 2, "program_cpu_s": 9.0}],
    }
    assert kill_extra_cpu(runs, "program_cpu_s") == [0.25, 0.0, None]
    assert kill_extra_cpu(runs, "donors_cpu_s") == [0.5, None, None]


def test_the_kill_runs_rebuild_from_memory_is_read_from_each_kill_runs_engine_counters():
    from bench.paging import kill_from_memory_mb

    runs = {"dlrm_region50_kill": [{"round": 0, "region_stats": {"rebuild_resident_bytes": 80_000_000}},
                                   {"round": 1, "error": "lost"}, {"round": 2, "region_stats": {}}]}
    assert kill_from_memory_mb(runs) == [80.0, None, None]
    assert kill_from_memory_mb({}) == []
