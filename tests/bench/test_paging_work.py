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
