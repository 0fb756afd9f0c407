"""The selector finder the Prometheus test relies on (tests/deploy/promql.py), fuzzed: from
expressions built out of PromQL's grammar it finds exactly the selectors that went in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.deploy.promql import PromQLError, selectors

NAMES = st.sampled_from(["up", "node_cpu_seconds_total", "cluster:dlshare_x:rate5m", "by_node", "sum_total",
                         "DCGM_FI_DEV_GPU_UTIL", "offsetx", "rate_limit", "_x"])
LABELS = st.sampled_from(["job", "instance", "le", "mode", "by", "on", "reason"])
VALUES = st.sampled_from(['"dlshare-node"', '"a,b"', '"}{[("', "'x'", '"$node"', '".*"', '"with \\" quote"'])


@st.composite
def selector(draw):
    name = draw(NAMES)
    matchers = draw(st.lists(st.tuples(LABELS, st.sampled_from(["=", "!=", "=~", "!~"]), VALUES), max_size=3,
                             unique_by=lambda m: m[0]))
    if not matchers:
        return name, name
    sp = draw(st.sampled_from(["", " "]))
    body = f",{sp}".join(f"{sp}{k}{sp}{op}{sp}{v}" for k, op, v in matchers)
    return f"{name}{{{body}}}", name + "{" + ", ".join(f"{k}{op}{v}" for k, op, v in matchers) + "}"


def expression(depth: int = 3):
    leaf = st.one_of(selector().map(lambda s: (s[0], [s[1]])),
                     st.sampled_from(["1", "0.5", "1e3", "0x1F", "Inf", "NaN", "3600"]).map(lambda n: (n, [])))
    if depth == 0:
        return leaf

    sub = expression(depth - 1)

    @st.composite
    def node(draw):
        kind = draw(st.sampled_from(["func", "range", "agg_before", "agg_after", "binop", "paren", "offset", "on"]))
        a_text, a_sel = draw(sub)
        if kind == "func":
            return f"{draw(st.sampled_from(['abs', 'clamp_min', 'label_replace']))}({a_text})", a_sel
        if kind == "range":
            s_text, s_sel = draw(selector())
            f = draw(st.sampled_from(["rate", "increase", "avg_over_time"]))
            return f"{f}({s_text}[{draw(st.sampled_from(['5m', '$__rate_interval', '1h:1m']))}])", [s_sel]
        labels = ", ".join(draw(st.lists(LABELS, min_size=1, max_size=3, unique=True)))
        agg = draw(st.sampled_from(["sum", "avg", "max", "count", "topk"]))
        mod = draw(st.sampled_from(["by", "without"]))
        if kind == "agg_before":
            return f"{agg} {mod} ({labels}) ({a_text})", a_sel
        if kind == "agg_after":
            return f"{agg}({a_text}) {mod} ({labels})", a_sel
        if kind == "paren":
            return f"({a_text})", a_sel
        if kind == "offset":
            s_text, s_sel = draw(selector())
            return f"{s_text} offset {draw(st.sampled_from(['5m', '1h30m', '-2m']))}", [s_sel]
        b_text, b_sel = draw(sub)
        op = draw(st.sampled_from(["+", "-", "/", "*", " and ", " or ", " unless ", " > ", " == bool "]))
        if kind == "on":
            return f"{a_text}{op}on ({labels}) group_left ({labels}) {b_text}", a_sel + b_sel
        return f"{a_text}{op}{b_text}", a_sel + b_sel

    return st.one_of(leaf, node())


@settings(max_examples=300, deadline=None)
@given(expression())
def test_it_finds_exactly_the_selectors_an_expression_was_built_from(case):
    text, sels = case
    want = list(dict.fromkeys(sels))
    assert selectors(text) == want, text


@pytest.mark.parametrize("expr, want", [
    ('sum by (le) (rate(dlshare_sched_job_wait_seconds_bucket{job="dlshare-sched"}[5m]))',
     ['dlshare_sched_job_wait_seconds_bucket{job="dlshare-sched"}']),
    ('instance:x:rate5m > 0 and on (instance) instance:y:rate1m > 0.1', ["instance:x:rate5m", "instance:y:rate1m"]),
    ('{__name__="up", job="a"} # a comment with name_total\n', ['{__name__="up", job="a"}']),
    ('1 - avg without (cpu, mode) (rate(node_cpu_seconds_total{mode="idle"}[1m]))',
     ['node_cpu_seconds_total{mode="idle"}']),
])
def test_known_expressions(expr, want):
    assert selectors(expr) == want


@pytest.mark.parametrize("bad", ['up{job="x', "rate(up[5m)", 'up{job="x}'])
def test_broken_expressions_are_errors(bad):
    with pytest.raises(PromQLError):
        selectors(bad)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_text_gives_selectors_or_a_clear_error(text):
    try:
        out = selectors(text)
    except PromQLError:
        return
    assert all(isinstance(s, str) and s for s in out)
