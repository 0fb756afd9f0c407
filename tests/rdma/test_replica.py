"""Replica states (rdma.replica): every transition goes through Replica.move, and only the allowed ones happen."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rdma.replica import EVICTING, LIVE, LOST, REBUILDING, Extent, Replica, ReplicaState

ALLOWED = {(LIVE, EVICTING), (LIVE, LOST), (REBUILDING, LIVE), (REBUILDING, LOST), (EVICTING, LOST)}


def replica(state: ReplicaState = LIVE, node: str = "n1") -> Replica:
    """A replica in ``state``, reached the only way there is: through move()."""
    rep = Replica(node, "127.0.0.1:1", 7, bytes(16), 1 << 20, REBUILDING if state is REBUILDING else LIVE)
    if state is EVICTING:
        rep.move(EVICTING)
    elif state is LOST:
        rep.move(LOST)
    assert rep.state is state
    return rep


@pytest.mark.parametrize("old", list(ReplicaState))
@pytest.mark.parametrize("new", list(ReplicaState))
def test_every_transition_is_allowed_or_refused(old, new):
    rep = replica(old)
    if old is LOST:
        assert rep.move(new) is None and rep.state is LOST  # final, whatever is asked
    elif (old, new) in ALLOWED:
        assert rep.move(new) is old and rep.state is new
    else:
        with pytest.raises(ValueError, match=f"from {old.value} to {new.value}"):
            rep.move(new)
        assert rep.state is old


def test_only_from_makes_a_move_conditional():
    rep = replica(LIVE)
    assert rep.move(LIVE, only_from=REBUILDING) is None and rep.state is LIVE
    assert rep.move(EVICTING, only_from=LIVE) is LIVE and rep.state is EVICTING
    assert rep.move(EVICTING, only_from=LIVE) is None  # already moved: no error, no change


def test_a_replica_starts_live_or_rebuilding():
    for bad in (EVICTING, LOST):
        with pytest.raises(ValueError):
            Replica("n", "h:1", 1, bytes(16), 4096, bad)
    assert Replica("n", "h:1", 1, bytes(16), 4096).describe() == {"node": "n", "slab": 1, "state": "live"}


def test_racing_losses_count_once():
    """Many threads report the same copy lost: exactly one of them sees it go."""
    for _ in range(20):
        rep = replica(LIVE)
        start = threading.Barrier(8)
        seen: list[ReplicaState | None] = []

        def lose():
            start.wait()
            seen.append(rep.move(LOST))

        threads = [threading.Thread(target=lose) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen.count(LIVE) == 1 and seen.count(None) == 7


def test_extent_orders_copies_for_reads_and_writes():
    live, rebuilding, evicting, lost = replica(LIVE, "a"), replica(REBUILDING, "b"), replica(EVICTING, "c"), \
        replica(LOST, "d")
    ext = Extent(0, 0, 4, [evicting, lost, rebuilding, live])
    assert ext.readable() == [live, evicting]  # a copy being evicted only after the live ones
    assert ext.writable() == [evicting, rebuilding, live]  # writes reach a copy being rebuilt
    assert ext.live_count() == 1
    offs, lens = Extent(1, 256, 256).segments(np.array([256, 258]), 4096)
    assert offs.tolist() == [0, 2 * 4096] and lens.tolist() == [4096, 4096]
