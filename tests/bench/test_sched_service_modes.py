"""`dlshare bench sched-service`'s burst modes and its HTTPS ratios, without running the bench."""

from argparse import Namespace

import pytest

from bench.sched_service import _burst_modes, _median_ratio


def test_burst_modes_parse_with_and_without_tls_in_the_order_given():
    modes = _burst_modes(Namespace(burst_modes="FULL-thread, full-thread-tls,NORMAL-loop,FULL-thread-tls"))
    assert modes == [("FULL", True, False), ("FULL", True, True), ("NORMAL", False, False), ("FULL", True, True)]
    for bad in ("FULL", "FULL-thread-ssl", "EXTRA-thread", "FULL-both"):
        with pytest.raises(SystemExit, match="SYNC-thread or SYNC-loop"):
            _burst_modes(Namespace(burst_modes=bad))


def test_the_https_ratios_are_medians_of_the_full_thread_runs_only():
    def run(tls, rate, sync="FULL", thread=True):
        return {"synchronous": sync, "api_thread": thread, "tls": tls, "submit_concurrent_per_s": rate}

    runs = [run(False, 100), run(True, 80), run(False, 120), run(True, 60), run(False, 110), run(True, 70),
            run(True, 1, sync="NORMAL"), run(False, 1000, thread=False)]
    assert _median_ratio(runs, "submit_concurrent_per_s") == pytest.approx(70 / 110)
    assert _median_ratio(runs[:1], "submit_concurrent_per_s") is None  # no HTTPS run
