"""The fleet's check for jobs that started twice (bench/fleet.py), on hand-made run logs."""

from bench.fleet import double_starts


def rec(t, op, node, job, cmd=""):
    return {"t": t, "op": op, "node": node, "job": job, "cmd": cmd}


def test_sequential_runs_are_fine_and_overlaps_are_named():
    ok = [rec(1, "run", "a", "j"), rec(2, "stop", "a", "j"), rec(3, "run", "b", "j"), rec(9, "exit", "b", "j")]
    assert double_starts(ok, {}, {"j": 2}) == []
    overlap = [rec(1, "run", "a", "j"), rec(3, "run", "b", "j"), rec(5, "exit", "a", "j")]
    [msg] = double_starts(overlap, {})
    assert "j: runs on a and b overlap" in msg


def test_a_run_lasts_until_its_node_died_and_runs_beyond_placements_count():
    recs = [rec(1, "run", "a", "j"), rec(4, "run", "b", "j")]  # a never said the run ended
    assert double_starts(recs, {"a": 3.0}, {"j": 2}) == []  # a died at 3: b's run came after
    assert double_starts(recs, {"a": 5.0}, {"j": 2})  # a was still alive at 4
    assert double_starts(recs, {"a": 3.0}, {"j": 1}) == ["j: 2 runs, 1 placements"]
