"""The trace parser: real traces, bad rows named, and hypothesis: only clean TraceErrors."""

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import data
from scheduler.trace import PHILLY, TraceError, parse_trace

HEADER = "job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s\n"

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
        jobs = parse_trace(text, "fuzz.csv")
    except TraceError as exc:
        assert "fuzz.csv" in str(exc)
    else:
        assert jobs and all(j.gpus >= 1 and j.duration_s > 0 for j in jobs)

@pytest.mark.parametrize("text,match", [
    ("job_id,model\n1,x\n", "missing columns"),
    (HEADER + "0,-5,ResNet-18,32,1,10,100\n", r"row 2: column arrival_s"),
    (HEADER + "0,0,ResNet-18,32,1,10,100\n1,1,NoSuchNet,32,1,10,100\n", r"row 3: unknown model"),
    (HEADER + "0,0,ResNet-18,32,0,10,100\n", r"row 2: column num_gpus"),
    (HEADER + "0,0,ResNet-18,32,1,10\n", r"row 2: 6 fields"),
    (HEADER + "0,0,ResNet-18,abc,1,10,100\n", r"row 2: column batch_size"),
    (HEADER + "0,0,ResNet-18,32,1,10,100\n0,1,ResNet-18,32,1,10,100\n", "row 3: duplicate job_id"),
    (HEADER, "no jobs"),
    ("job_id,model,arrival_h,iterations,num_gpus\n0,nonet,0,10,1\n", "row 2: unknown model"),
])
def test_bad_traces_name_the_row(text, match):
    with pytest.raises(TraceError, match=match):
        parse_trace(text, "t.csv", data.gavel_throughputs()["v100"], data.synergy_sensitivity()["models"])
