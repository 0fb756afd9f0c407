import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from nodesvc.node_core import AllocateSpec, ReplyCache, RunSpec, StopSpec, parse_op

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_parse_command_random_bytes_only_payload_error(raw):
    try:
        cmd = messages.parse_command(raw)
    except PayloadError:
        return
    assert isinstance(cmd.id, str) and cmd.id and isinstance(cmd.args, dict)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["schema", "id", "op", "args", "x"]), json_values, max_size=5))
def test_parse_command_random_objects(obj):
    raw = json.dumps(obj).encode()
    try:
        cmd = messages.parse_command(raw)
    except PayloadError as exc:
        assert str(exc)  # every rejection says why
        return
    assert obj["schema"] == 1 and cmd.op == obj["op"]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["ping", "allocate", "release", "run", "stop", "nope"]),
       st.dictionaries(st.sampled_from(["job", "pids", "cpus", "cpuset", "memory_bytes", "argv", "env", "cwd",
                                        "signal", "gpus"]), json_values, max_size=6))
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


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({"schema": st.just(1)}, optional={
    "node": st.one_of(st.text(max_size=10), st.integers(), st.none()),
    "ts": json_values, "cpu": json_values, "gpus": json_values, "rdma": json_values,
    "memory": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "total_bytes": json_values, "available_bytes": json_values}))}))
def test_parse_telemetry_random_objects(obj):
    try:
        t = messages.parse_telemetry(json.dumps(obj))
    except PayloadError as exc:
        assert str(exc)
        return
    assert messages.valid_id(t["node"]) and t["memory"]["total_bytes"] >= 0


def test_long_op_names_are_refused_not_echoed():
    with pytest.raises(PayloadError, match="'op'") as ei:
        messages.parse_command(json.dumps({"schema": 1, "id": "x", "op": "a" * 100_000}))
    assert len(str(ei.value)) < 200
    with pytest.raises(PayloadError, match="out of range"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "cpus": 10**400}))
    with pytest.raises(PayloadError, match="cannot be allocated"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "pids": [1]}))


def test_good_command_and_errors():
    cmd = messages.parse_command(messages.command("allocate", "c1", job="j-1", cpus=0.5, memory_bytes=64 << 20))
    spec = parse_op(cmd)
    assert isinstance(spec, AllocateSpec) and spec.alloc.cpus == 0.5 and spec.alloc.memory_bytes == 64 << 20
    for bad, msg in [
        (b'{"schema":1,"op":"ping"}', "'id'"),
        (b'{"schema":2,"id":"a","op":"ping"}', "unsupported schema"),
        (b'[1,2]', "JSON object"),
        (b'\xff\xfe', "UTF-8"),
        (b'{"schema":1,"id":"a","op":"x","args":[]}', "'args'"),
        (b'{"schema":1,"id":"a","op":"ping","v":NaN}', "NaN"),
    ]:
        with pytest.raises(PayloadError, match=None) as ei:
            messages.parse_command(bad)
        assert msg in str(ei.value), (bad, ei.value)
    with pytest.raises(PayloadError, match="job id"):
        parse_op(messages.Command("c", "release", {"job": "../etc"}))
    with pytest.raises(PayloadError, match="cpuset"):
        parse_op(messages.Command("c", "allocate", {"job": "j", "cpuset": "3-1"}))
    with pytest.raises(PayloadError, match="unknown op"):
        parse_op(messages.Command("c", "format-disk", {}))
    assert isinstance(parse_op(messages.Command("c", "stop", {"job": "j", "signal": "kill"})), StopSpec)
    assert messages.command_id_of(b'{"id":"x1","schema":9}') == "x1"


def test_reply_cache_is_bounded_lru():
    c = ReplyCache(capacity=2)
    c.put("a", b"1")
    c.put("b", b"2")
    assert c.get("a") == b"1"
    c.put("c", b"3")  # evicts b, the least recently used
    assert c.get("b") is None and c.get("a") == b"1" and len(c) == 2


def test_oversized_payload_refused_unparsed():
    with pytest.raises(PayloadError, match="exceeds"):
        messages.decode(b" " * (messages.MAX_PAYLOAD + 1))
