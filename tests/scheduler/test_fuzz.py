"""Hypothesis on the trace parser and the profile loader: only clean errors."""

import string

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
