"""The node daemon's pure core (nodesvc.node_core): command arguments into typed specs, and idempotence."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from nodesvc.node_core import AllocateSpec, ReplyCache, RunSpec, StopSpec, parse_op, thread_groups
from tests.nodesvc.strategies import json_values


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["ping", "allocate", "release", "run", "stop", "nope"]),
       st.dictionaries(st.sampled_from(["job", "pids", "cpus", "cpuset", "memory_bytes", "argv", "env", "cwd",
                                        "signal", "gpus", "run_id", "user"]), json_values, max_size=6))
def test_parse_op_random_args_only_payload_error(op, args):
    try:
        spec = parse_op(messages.Command("c", op, args))
    except PayloadError as exc:
        assert str(exc)
        return
    if isinstance(spec, AllocateSpec):
        assert messages.valid_id(spec.alloc.job)
    if isinstance(spec, RunSpec):
        assert spec.argv and all(isinstance(a, str) for a in spec.argv)
        assert spec.user is None or (spec.user.isprintable() and "/" not in spec.user and len(spec.user) <= 32)


def test_run_names_its_owner_by_a_user_name_only():
    """Promise: run's user is a user name (resolved on the node), never a uid or a path."""
    run = lambda **a: parse_op(messages.Command("c", "run", {"job": "j", "argv": ["true"], **a}))  # noqa: E731
    assert run(user="alice").user == "alice" and run().user is None
    for bad in ("root\n", "0", "../etc", "", "a" * 33, 1000, ["alice"], "al ice"):
        with pytest.raises(PayloadError, match="user"):
            run(user=bad)
    with pytest.raises(PayloadError, match="cwd"):
        run(cwd="relative/dir")


def test_parse_op_specs_and_refusals_say_why():
    spec = parse_op(messages.Command("c1", "allocate", {"job": "j-1", "cpus": 0.5, "memory_bytes": 64 << 20}))
    assert isinstance(spec, AllocateSpec) and spec.alloc.cpus == 0.5 and spec.alloc.memory_bytes == 64 << 20
    with pytest.raises(PayloadError, match="out of range"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "cpus": 10**400}))
    with pytest.raises(PayloadError, match="cannot be allocated"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "pids": [1]}))
    with pytest.raises(PayloadError, match="job id"):
        parse_op(messages.Command("c", "release", {"job": "../etc"}))
    with pytest.raises(PayloadError, match="cpuset"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "cpuset": "3-1"}))
    with pytest.raises(PayloadError, match="unknown op"):
        parse_op(messages.Command("c", "format-disk", {}))
    assert isinstance(parse_op(messages.Command("c", "stop", {"job": "j", "signal": "kill"})), StopSpec)
    run = {"job": "j", "argv": ["true"]}
    assert parse_op(messages.Command("c", "run", {**run, "run_id": "ev-1/place"})).run_id == "ev-1/place"
    assert parse_op(messages.Command("c", "run", run)).run_id == ""
    for bad in ("x" * 257, "a\nb"):
        with pytest.raises(PayloadError, match="run_id"):
            parse_op(messages.Command("c", "run", {**run, "run_id": bad}))


def test_reply_cache_is_bounded_lru():
    c = ReplyCache(capacity=2)
    c.put("a", b"1")
    c.put("b", b"2")
    assert c.get("a") == b"1"
    c.put("c", b"3")  # evicts b, the least recently used
    assert c.get("b") is None and c.get("a") == b"1" and len(c) == 2


def test_thread_groups_resolve_threads_and_refuse_those_of_protected_processes():
    protected = frozenset({1, 100})
    # 201 is a thread of process 200, 300 is gone: the allocation moves process 200, once
    assert thread_groups((200, 201, 300), {200: 200, 201: 200, 300: None}, protected) == (200,)
    with pytest.raises(PayloadError, match="thread 101 of process 100"):
        thread_groups((200, 101), {200: 200, 101: 100}, protected)
    with pytest.raises(PayloadError, match="pid 100 "):
        thread_groups((100,), {100: 100}, protected)
