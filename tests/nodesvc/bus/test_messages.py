"""The MQTT payload codec (nodesvc.bus.messages): every malformed payload is a PayloadError that says why."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus import messages
from nodesvc.bus.messages import PayloadError
from tests.nodesvc.strategies import json_values


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


def test_good_command_and_errors():
    cmd = messages.parse_command(messages.command("allocate", "c1", job="j-1", cpus=0.5, memory_bytes=64 << 20))
    assert (cmd.id, cmd.op, cmd.args) == ("c1", "allocate", {"job": "j-1", "cpus": 0.5, "memory_bytes": 64 << 20})
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
    assert messages.command_id_of(b'{"id":"x1","schema":9}') == "x1"


def test_ids_end_where_they_end_and_unparsable_commands_still_name_theirs():
    for bad in ("job\n", "job\r", "a/b", "", "a" * 129, ".x"):
        assert not messages.valid_id(bad), bad
    deep = b'{"schema":1,"id":"d1","op":"allocate","args":' + b"[" * 5000 + b"]" * 5000 + b"}"
    huge = b'{"schema":1,"id":"h\\"1","op":"x","args":{"n":' + b"9" * 5000 + b"}}"
    for raw, cid in ((deep, "d1"), (huge, 'h"1'), (b'{"id":"c1","op":"x","args":{', "c1"), (b"\xff", None)):
        with pytest.raises(PayloadError):
            messages.parse_command(raw)
        assert messages.command_id_of(raw) == cid


def test_bounded_numbers():
    assert messages.bounded({"x": 2}, "x", 0, 5) == 2.0
    assert messages.bounded({}, "x", 0, 5, required=False, default=0.0) == 0.0
    for v in (float("inf"), 1e308, -1, 10**400):
        with pytest.raises(PayloadError, match="'x'"):
            messages.bounded({"x": v}, "x", 0, 5)
    with pytest.raises(PayloadError, match="'n'"):
        messages.bounded({"n": 10**30}, "n", 0, 5, int)


def test_oversized_payload_refused_unparsed():
    with pytest.raises(PayloadError, match="exceeds"):
        messages.decode(b" " * (messages.MAX_PAYLOAD + 1))
