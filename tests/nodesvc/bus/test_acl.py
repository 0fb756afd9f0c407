"""Broker users and topic rights in mosquitto's formats (nodesvc.bus.acl), as the embedded broker
enforces them: the deploy ACL's rules, the wildcard algebra (fuzzed), and password files that
mosquitto_passwd and dlshare both write."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus.acl import (
    AclError, filter_covers, filters_overlap, parse_acl, parse_passwords, password_line, topic_matches,
)

ROOT = Path(__file__).resolve().parents[3]
DEPLOY_ACL = (ROOT / "deploy" / "mosquitto" / "dlshare.acl").read_text()


def test_the_deploy_acl_gives_each_principal_its_topics():
    acl = parse_acl(DEPLOY_ACL)
    assert acl.may("node-1", "write", "dlshare/v1/node/node-1/telemetry")
    assert not acl.may("node-1", "write", "dlshare/v1/node/node-2/telemetry")
    assert not acl.may("node-1", "write", "dlshare/v1/node/node-1/cmd")
    assert acl.may("node-1", "read", "dlshare/v1/node/node-1/cmd")
    assert not acl.may("node-1", "read", "dlshare/v1/node/node-2/cmd")
    assert acl.may("dlshare-sched", "write", "dlshare/v1/node/node-2/cmd")
    assert acl.may("dlshare-sched", "read", "dlshare/v1/node/node-2/reply")
    assert not acl.may("dlshare-sched", "write", "dlshare/v1/node/node-2/state")
    assert acl.may("dlshare-operator", "read", "dlshare/v1/agg/agg0/state")
    assert not acl.may(None, "read", "dlshare/v1/node/node-1/state")  # anonymous: nothing
    assert not acl.may("stranger", "write", "dlshare/v1/node/x/cmd")
    # Subscriptions: the whole filter must be readable.
    assert acl.may_subscribe("dlshare-sched", "dlshare/v1/node/+/telemetry")
    assert acl.may_subscribe("node-1", "dlshare/v1/node/node-1/cmd")
    assert not acl.may_subscribe("node-1", "dlshare/v1/node/+/cmd")
    assert not acl.may_subscribe("dlshare-sched", "dlshare/#")
    assert acl.may_subscribe("dlshare-operator", "dlshare/#")


def test_patterns_never_turn_a_name_into_a_wildcard():
    """Promise: a user (or client id) named with + # or / gets no pattern rights, as in mosquitto."""
    acl = parse_acl("pattern write dlshare/v1/node/%u/telemetry\npattern read c/%c\n")
    assert not acl.may("+", "write", "dlshare/v1/node/x/telemetry")
    assert not acl.may("a/b", "write", "dlshare/v1/node/a/b/telemetry")
    assert acl.may("ok", "read", "c/client-1", client_id="client-1")
    assert not acl.may("ok", "read", "c/x", client_id="#")


def test_deny_wins_and_bad_lines_are_named():
    acl = parse_acl("user u\ntopic readwrite a/#\ntopic deny a/secret\ntopic b\n")
    assert acl.may("u", "write", "a/x") and not acl.may("u", "read", "a/secret")
    assert acl.may("u", "read", "b") and acl.may("u", "write", "b")  # no access word: readwrite
    assert not acl.may_subscribe("u", "a/#")  # it would cover the denied topic
    for bad, what in (("frob x", "line 1"), ("user\n", "line 1"), ("topic read a/#/b", "line 1"),
                      ("# c\ntopic read a+", "line 2")):
        with pytest.raises(AclError, match=what):
            parse_acl(bad)


LEVELS = st.sampled_from(["a", "b", "+", "#"])
FILTERS = st.lists(LEVELS, min_size=1, max_size=4).map("/".join).filter(
    lambda f: "#" not in f[:-1] and f.count("#") <= 1)
TOPICS = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=5).map("/".join)


@settings(max_examples=300, deadline=None)
@given(FILTERS, FILTERS, TOPICS)
def test_covers_and_overlap_agree_with_matching(grant, flt, topic):
    if filter_covers(grant, flt) and topic_matches(flt, topic):
        assert topic_matches(grant, topic)
    if topic_matches(grant, topic) and topic_matches(flt, topic):
        assert filters_overlap(grant, flt)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_acl_text_parses_or_names_its_line(text):
    try:
        acl = parse_acl(text)
    except AclError as exc:
        assert "line" in str(exc)
        return
    acl.may("u", "read", "a/b")
    acl.may_subscribe("u", "a/#")


def test_passwords_round_trip_and_match_mosquitto_passwd(tmp_path):
    entries = parse_passwords(password_line("alice", "pw-1") + "\n" + password_line("bob", "pw-2") + "\n")
    assert entries["alice"].verify("pw-1") and not entries["alice"].verify("pw-2") and entries["bob"].verify("pw-2")
    tool = shutil.which("mosquitto_passwd")
    if tool:  # the file mosquitto itself writes is read the same way
        f = tmp_path / "pw"
        f.touch()
        subprocess.run([tool, "-b", str(f), "carol", "pw-3"], check=True, capture_output=True)
        assert parse_passwords(f.read_text())["carol"].verify("pw-3")
    for bad in ("nocolon", "u:$6$abc$def", "u:$7$x$AAAA$BBBB", "u:$7$101$!!$AAAA"):
        with pytest.raises(AclError, match="line 1"):
            parse_passwords(bad)


def test_the_packaged_acl_is_the_deploy_acl():
    """Promise: dlshare up's broker enforces exactly deploy/mosquitto/dlshare.acl (the package
    carries a copy, for installs without the checkout)."""
    assert (ROOT / "nodesvc" / "bus" / "dlshare.acl").read_text() == DEPLOY_ACL
