"""Events and decisions round-trip through plain dicts; bad dicts get a CodecError."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Job, JobArrived, JobFinished, JobSample, Node, NodeLost, NodeReport, SchedulerState, Tick
from scheduler.codec import CodecError, decision_from_dict, decision_to_dict, event_from_dict, event_to_dict

EVENTS = [
    JobArrived("a", 1.0, Job("j", "ResNet-18", 32, gpus=2, cpus=4.0, priority=1, features={"flops": 1e9})),
    JobFinished("b", 2.0, "j", failed=True, reason="oom"),
    Tick("c", 3.0),
    NodeReport("d", 4.0, Node("n0", 4, 12, 1 << 30, lendable_bytes=5), gpu_util=(10.0, 20.0), cpu_percent=5.0,
               jobs={"j": JobSample(sm_percent=40.0, mem_percent=None, speed=0.8)}),
    NodeLost("e", 5.0, "n0"),
]


def test_events_round_trip_through_json():
    for ev in EVENTS:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev


def test_replaying_a_logged_run_gives_the_same_decisions():
    log = [event_to_dict(e) for e in (
        NodeReport("r", 0.0, Node("n0", 2, 8, 1 << 30)),
        JobArrived("a1", 1.0, Job("x", "m", gpus=1)), JobArrived("a2", 2.0, Job("y", "m", gpus=2)),
        JobFinished("f", 9.0, "x"), Tick("t", 400.0))]

    def run():
        st_ = SchedulerState("las")
        return [decision_to_dict(d) for e in log for d in st_.handle(event_from_dict(json.loads(json.dumps(e))))]

    first = run()
    assert first == run() and first
    assert [decision_from_dict(d) for d in first]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "id", "now", "job", "node", "jobs", "gpu_util", "failed"]),
                       st.one_of(st.none(), st.text(max_size=6), st.integers(), st.floats(), st.lists(st.integers(), max_size=2),
                                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                                 st.sampled_from(["JobArrived", "NodeReport", "Tick", "JobFinished"])), max_size=6))
def test_bad_dicts_raise_codec_error_only(d):
    try:
        event_from_dict(d)
    except CodecError:
        pass
