"""Events and decisions round-trip through plain dicts; bad dicts get a CodecError; logs written
before the event convention (``id``/``cause`` for ``stimulus_id``) still read; every event and
decision follows the convention."""

import dataclasses
import inspect
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    DonorReclaimed, Job, JobArrived, JobBound, JobCancelled, JobFinished, JobSample, JobStarted, JobState, Node, NodeLost, NodeReport,
    PlacementFailed, Release, SchedulerState, Tick, events,
)
from scheduler.codec import CodecError, decision_from_dict, decision_to_dict, event_from_dict, event_to_dict

EVENTS = [
    JobArrived("a", 1.0, Job("j", "ResNet-18", 32, gpus=2, cpus=4.0, priority=1, features={"flops": 1e9})),
    JobFinished("b", 2.0, "j", failed=True, reason="oom"),
    Tick("c", 3.0),
    NodeReport("d", 4.0, Node("n0", 4, 12, 1 << 30, lendable_bytes=5), gpu_util=(10.0, 20.0), cpu_percent=5.0,
               jobs={"j": JobSample(sm_percent=40.0, mem_percent=None, speed=0.8)}),
    NodeLost("e", 5.0, "n0"),
    JobCancelled("f", 6.0, "j", "by user"),
    PlacementFailed("g", 7.0, "j", "out of GPU memory"),
    JobStarted("h", 8.0, "j", "n0", "arrive-1"),
    JobFinished("m", 11.0, "j", node="n0"),
    PlacementFailed("n", 12.0, "j", "refused", place_id="arrive-1"),
    JobBound("i", 9.0, Job("k8s.ml.p", "unknown", gpus=0, cpus=0.5, memory_bytes=1 << 28), "n0", (), 120.0),
    JobBound("k", 9.5, Job("k8s.ml.q", "resnet50", gpus=2), "n0", (1, 3), None),
    NodeReport("l", 10.0, Node("n1", 0, 8, 1 << 30), running=("j", "x")),
    DonorReclaimed("o", 13.0, "prep0", 1 << 33),
]


def _classes(base: type) -> list[type]:
    return [c for _, c in inspect.getmembers(events, inspect.isclass)
            if issubclass(c, base) and c.__module__ == events.__name__]


def test_every_event_starts_with_stimulus_id_and_now():
    classes = _classes(events.Event)
    assert len(classes) >= 10  # the base and nine events
    for cls in classes:
        fields = dataclasses.fields(cls)
        assert [(f.name, f.type) for f in fields[:2]] == [("stimulus_id", "str"), ("now", "float")], cls
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    assert {c.__name__ for c in classes} - {"Event"} == {type(e).__name__ for e in EVENTS}  # all covered here


def test_every_decision_carries_the_stimulus_id_of_its_event():
    classes = _classes(events.Decision)
    assert len(classes) >= 6
    for cls in classes:
        assert dataclasses.fields(cls)[0].name == "stimulus_id", cls
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    st_ = SchedulerState("las", [Node("n0", 1, 4, 1 << 30)])
    st_.handle(JobArrived("arrive-x", 0.0, Job("x", "m", gpus=1)))
    out = st_.handle(JobArrived("arrive-y", 1.0, Job("y", "m", gpus=1))) + st_.handle(Tick("tick-1", 400.0))
    assert {type(d).__name__ for d in out} >= {"Preempt", "Place", "Allocate"}
    assert {d.stimulus_id for d in out} <= {"arrive-y", "tick-1"} and any(d.stimulus_id == "tick-1" for d in out)


def test_events_round_trip_through_json():
    for ev in EVENTS:
        d = event_to_dict(ev)
        assert list(d)[:3] == ["type", "stimulus_id", "now"]
        assert event_from_dict(json.loads(json.dumps(d))) == ev


def _old_keys(d: dict, new: str, old: str) -> dict:
    """A dict as the version before the event convention wrote it (``old`` for ``new``)."""
    return {(old if k == new else k): v for k, v in d.items()}


def test_events_and_decisions_logged_with_the_old_keys_still_read():
    for ev in EVENTS:
        old = _old_keys(event_to_dict(ev), "stimulus_id", "id")
        assert "stimulus_id" not in old and old["id"] == ev.stimulus_id
        assert event_from_dict(json.loads(json.dumps(old))) == ev
    st_ = SchedulerState("fifo", [Node("n0", 2, 8, 1 << 30)])
    decisions = st_.handle(JobArrived("a1", 1.0, Job("x", "m", gpus=1)))
    assert decisions
    for d in decisions:
        old = _old_keys(decision_to_dict(d), "stimulus_id", "cause")
        assert decision_from_dict(json.loads(json.dumps(old))) == d


def test_a_release_round_trips_with_its_state():
    d = Release("s", "j", ("n0", "n1"), JobState.PREEMPTED, "node n2 lost", stop=True)
    assert decision_to_dict(d)["state"] == "preempted"
    assert decision_from_dict(json.loads(json.dumps(decision_to_dict(d)))) == d


def test_a_missing_stimulus_id_is_named():
    with pytest.raises(CodecError, match="stimulus_id"):
        event_from_dict({"type": "Tick", "now": 1.0})
    with pytest.raises(CodecError, match="Wakeup"):
        decision_from_dict({"type": "Wakeup", "at": 1.0})


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
@given(st.dictionaries(st.sampled_from(["type", "stimulus_id", "id", "now", "job", "node", "jobs", "gpu_util", "failed",
                                        "running", "gpus", "hold_s"]),
                       st.one_of(st.none(), st.text(max_size=6), st.integers(), st.floats(), st.lists(st.integers(), max_size=2),
                                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                                 st.sampled_from(["JobArrived", "NodeReport", "Tick", "JobFinished", "JobStarted",
                                                  "JobBound"])), max_size=6))
def test_bad_dicts_raise_codec_error_only(d):
    try:
        ev = event_from_dict(d)
    except CodecError as exc:
        assert str(exc)  # names the field or the type at fault
    else:  # what it accepted is a well-formed event that survives another round trip
        assert isinstance(ev, events.Event) and ev.stimulus_id and event_from_dict(event_to_dict(ev)) == ev


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["type", "stimulus_id", "cause", "job", "node", "shards", "at", "cpus", "nodes",
                                        "state"]),
                       st.one_of(st.none(), st.text(max_size=6), st.integers(), st.floats(allow_nan=False),
                                 st.lists(st.dictionaries(st.sampled_from(["node", "gpus"]), st.integers()), max_size=2),
                                 st.sampled_from(["Place", "Wakeup", "Allocate", "Reject", "Release", "failed"])),
                       max_size=6))
def test_bad_decision_dicts_raise_codec_error_only(d):
    try:
        dec = decision_from_dict(d)
    except CodecError as exc:
        assert str(exc)
    else:
        assert isinstance(dec, events.Decision)
