"""Hypothesis on the trace parser and the profile loader: only clean errors."""

import string

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.profile import ProfileError, parse_profile
from scheduler.trace import PHILLY, TraceError, parse_trace

cell = st.one_of(st.text(string.printable, max_size=8), st.integers(-5, 10**6).map(str),
                 st.floats(allow_nan=True, allow_infinity=True).map(str))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(cell, min_size=0, max_size=9), max_size=6), st.booleans())
def test_trace_parser_fails_only_with_trace_error(rows, with_header):
    lines = ([",".join(PHILLY)] if with_header else []) + [",".join(r) for r in rows]
    try:
        jobs = parse_trace("\n".join(lines) + "\n", "fuzz.csv")
    except TraceError as exc:
        assert "fuzz.csv" in str(exc)
        return
    for j in jobs:
        assert j.arrival_s >= 0 and j.gpus >= 1 and j.duration_s > 0


def test_an_infinite_count_is_a_trace_error_not_an_overflow():
    row = {c: "1" for c in PHILLY}
    row["num_gpus"] = "inf"  # int(float("inf")) raises OverflowError, which hypothesis once found
    text = ",".join(PHILLY) + "\n" + ",".join(row[c] for c in PHILLY) + "\n"
    with pytest.raises(TraceError, match="num_gpus: must be finite"):
        parse_trace(text, "inf.csv")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_trace_parser_on_arbitrary_text(text):
    try:
        parse_trace(text, "fuzz.csv")
    except TraceError:
        pass


scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=False), st.text(max_size=10))
plugin_names = st.sampled_from(["fifo", "las", "gittins", "consolidate", "random", "nope", "proportional", "synergy"])
spec = st.one_of(plugin_names, st.fixed_dictionaries({"plugin": plugin_names},
                                                    optional={"weight": scalar, "args": st.dictionaries(st.text(max_size=5), scalar, max_size=2)}),
                 scalar)
profile = st.fixed_dictionaries({}, optional={
    "name": scalar, "order": spec, "filter": st.lists(spec, max_size=2), "score": st.lists(spec, max_size=2),
    "allocate": spec, "placement": st.dictionaries(
        st.sampled_from(["share", "max_share", "share_max_gpus", "backfill", "nodes_to_score_percent", "min_run_s", "x"]),
        st.one_of(scalar, st.sampled_from(["never", "when_full", "always"])), max_size=4),
    "bogus": scalar})


@settings(max_examples=400, deadline=None)
@given(profile)
def test_profile_loader_fails_only_with_profile_error(d):
    try:
        p = parse_profile(d, "fuzz")
    except ProfileError as exc:
        assert "fuzz" in str(exc)
        return
    assert p.share in ("never", "when_full", "always") and p.max_share >= 1


from scheduler import (  # noqa: E402
    Job, JobArrived, JobCancelled, JobFinished, JobSample, Node, NodeLost, NodeReport, PlacementFailed,
    SchedulerError, SchedulerState, Tick,
)

job_ids = st.sampled_from(["a", "b", "c", "d"])
node_ids = st.sampled_from(["n0", "n1", "n2"])
event = st.one_of(
    st.builds(lambda j, g, m: ("arrive", j, g, m), job_ids, st.integers(1, 9), st.sampled_from("XY")),
    st.builds(lambda j, f: ("finish", j, f), job_ids, st.booleans()),
    st.builds(lambda j: ("cancel", j), job_ids),
    st.builds(lambda j: ("failed", j), job_ids),
    st.just(("tick",)),
    st.builds(lambda n, g, s: ("report", n, g, s), node_ids, st.integers(0, 4), st.floats(0, 2)),
    st.builds(lambda n: ("lost", n), node_ids),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["fifo", "las", "gandiva", "dlshare"]), st.lists(st.tuples(event, st.floats(-5, 100)), max_size=25))
def test_core_never_fails_except_with_scheduler_error(profile, steps):
    core = SchedulerState(profile, [Node("n0", 2, 8, 1 << 34)])
    now = 0.0
    for k, (ev, dt) in enumerate(steps):
        now += dt
        kind = ev[0]
        if kind == "arrive":
            e = JobArrived(f"e{k}", now, Job(ev[1], ev[3], gpus=ev[2]))
        elif kind == "finish":
            e = JobFinished(f"e{k}", now, ev[1], failed=ev[2])
        elif kind == "cancel":
            e = JobCancelled(f"e{k}", now, ev[1])
        elif kind == "failed":
            e = PlacementFailed(f"e{k}", now, ev[1])
        elif kind == "tick":
            e = Tick(f"e{k}", now)
        elif kind == "report":
            e = NodeReport(f"e{k}", now, Node(ev[1], ev[2], 8, 1 << 34),
                           jobs={j: JobSample(speed=ev[3]) for j in core.running})
        else:
            e = NodeLost(f"e{k}", now, ev[1])
        before = core.now
        try:
            core.handle(e)
        except SchedulerError:
            assert core.now == before  # a refused event leaves the clock alone
            now = max(now, core.now)
            continue
        alive = [ns for ns in core.nodes.values() if ns.alive]
        assert core.free_gpus == sum(sum(1 for r in ns.residents if not r) for ns in alive)
        for rec in core.running.values():
            assert all(rec.job.id in core.nodes[sh.node].residents[g] for sh in rec.shards for g in sh.gpus)
