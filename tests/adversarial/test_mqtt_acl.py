"""The broker as the node commands' gate: deploy/mosquitto/dlshare.{conf,acl} in a real mosquitto,
and the same ACL file in the embedded broker (amqtt, ``dlshare broker --password-file --acl-file``,
what ``dlshare up`` runs): every test runs against both.

Node commands are authenticated by the broker alone, so the ACL is the security boundary of
every attack in test_node_commands.py: these tests check that the example ACL draws it where
the README's Security section says.  "Not delivered" is checked with a barrier: a message the
same publisher may send, published after the forbidden one; a broker delivers one client's
QoS 1 messages to a subscriber in order, so once the barrier is in, the forbidden one would be too."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from pathlib import Path

import aiomqtt
import pytest

from nodesvc.bus.acl import password_line
from nodesvc.bus.procs import free_port, stop_proc, wait_port
from tests.adversarial.conftest import PY, ROOT

DEPLOY = ROOT / "deploy" / "mosquitto"
USERS = ("n1", "n2", "dlshare-sched", "dlshare-memory", "dlshare-operator", "mallory")


@pytest.fixture(scope="module", params=["mosquitto", "amqtt"])
def acl_broker(request, tmp_path_factory):
    """mosquitto with the example conf and ACL, or the embedded broker with the same ACL file; a
    password per user (the password is the name)."""
    tmp = tmp_path_factory.mktemp("acl")
    pw = tmp / "passwd"
    pw.touch(mode=0o600)
    port = free_port()
    if request.param == "amqtt":
        pw.write_text("".join(password_line(u, u) + "\n" for u in USERS))
        with open(tmp / "amqtt.log", "ab") as log:
            proc = subprocess.Popen([PY, "-m", "nodesvc.cli", "broker", "--listen", f"127.0.0.1:{port}",
                                     "--password-file", str(pw), "--acl-file", str(DEPLOY / "dlshare.acl")],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_port(port, proc=proc)
        yield port
        stop_proc(proc)
        return
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    passwd_tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    for user in USERS:
        subprocess.run([passwd_tool, "-b", str(pw), user, user], check=True, capture_output=True)
    conf = (DEPLOY / "dlshare.conf").read_text()
    conf = (conf.replace("listener 1883", f"listener {port} 127.0.0.1")
                .replace("/etc/mosquitto/dlshare.passwd", str(pw))
                .replace("/etc/mosquitto/dlshare.acl", str(DEPLOY / "dlshare.acl"))
                .replace("persistence true", "persistence false"))
    conf += "user root\n"  # mosquitto started as root drops to its own user, which cannot read pytest's tmp
    (tmp / "mosquitto.conf").write_text(conf)
    with open(tmp / "mosquitto.log", "ab") as log:
        proc = subprocess.Popen([exe, "-c", str(tmp / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc=proc)
    yield port
    stop_proc(proc)


def _client(port: int, user: str | None) -> aiomqtt.Client:
    return aiomqtt.Client("127.0.0.1", port, identifier=f"{user}-{uuid.uuid4().hex[:6]}",
                          username=user, password=user, timeout=5)


async def _received(sub: aiomqtt.Client, barrier: str, timeout: float = 10.0) -> list[str]:
    """Topics of the messages ``sub`` receives up to and including one on ``barrier``."""
    got = []

    async def run() -> None:
        async for msg in sub.messages:
            got.append(str(msg.topic))
            if str(msg.topic) == barrier:
                return

    await asyncio.wait_for(run(), timeout)
    return got


async def test_anonymous_clients_are_refused(acl_broker):
    """Promise: with the example conf, a client without a user and password cannot connect."""
    with pytest.raises(aiomqtt.MqttError):
        async with _client(acl_broker, None):
            pass
    with pytest.raises(aiomqtt.MqttError):
        async with aiomqtt.Client("127.0.0.1", acl_broker, username="n1", password="wrong", timeout=5):
            pass


async def test_a_node_publishes_only_under_its_own_id(acl_broker):
    """Promise: a (compromised) node cannot forge another node's telemetry, state (Last Will),
    command replies or job events, nor send commands to another node."""
    async with _client(acl_broker, "dlshare-operator") as watch, _client(acl_broker, "n1") as n1:
        await watch.subscribe("dlshare/#", qos=1)
        for leaf in ("telemetry", "state", "reply", "events", "cmd"):
            await n1.publish(f"dlshare/v1/node/n2/{leaf}", b'{"schema":1}', qos=1)
        await n1.publish("dlshare/v1/node/n1/cmd", b'{"schema":1}', qos=1)  # not even its own commands
        await n1.publish("dlshare/v1/node/n1/telemetry", b'{"schema":1}', qos=1)  # the barrier: allowed
        got = await _received(watch, "dlshare/v1/node/n1/telemetry")
    assert got == ["dlshare/v1/node/n1/telemetry"], got


async def test_a_node_reads_only_its_own_commands(acl_broker):
    """Promise: a node cannot read another node's commands nor any node's replies (which carry
    slab tokens): its subscription to them stays silent."""
    async with _client(acl_broker, "dlshare-sched") as sched, _client(acl_broker, "n1") as n1:
        await n1.subscribe("dlshare/v1/node/+/cmd", qos=1)  # mosquitto takes it and filters each delivery;
        await n1.subscribe("dlshare/v1/node/+/reply", qos=1)  # the embedded broker refuses the whole filter
        await n1.subscribe("dlshare/v1/node/n1/cmd", qos=1)
        await sched.publish("dlshare/v1/node/n2/cmd", b'{"schema":1,"op":"map"}', qos=1)
        await sched.publish("dlshare/v1/node/n1/cmd", b'{"schema":1,"op":"ping"}', qos=1)  # the barrier
        got = await _received(n1, "dlshare/v1/node/n1/cmd")
    assert got == ["dlshare/v1/node/n1/cmd"], got


async def test_only_the_scheduler_and_operators_command_nodes_and_consumers_only_borrow(acl_broker):
    """Promise: an authenticated client without a grant (mallory) cannot publish on a node's
    command topic; the scheduler and operators can; memory consumers (the credential jobs get)
    cannot publish there, only on the node's mem topic, which the node takes map/unmap/renew
    from and nothing else."""
    async with _client(acl_broker, "n2") as n2:
        await n2.subscribe("dlshare/v1/node/n2/cmd", qos=1)
        await n2.subscribe("dlshare/v1/node/n2/mem", qos=1)
        async with _client(acl_broker, "mallory") as m:
            await m.publish("dlshare/v1/node/n2/cmd", b'{"schema":1,"op":"allocate"}', qos=1)
            await m.publish("dlshare/v1/node/n2/mem", b'{"schema":1,"op":"map"}', qos=1)
        async with _client(acl_broker, "dlshare-memory") as c:
            await c.publish("dlshare/v1/node/n2/cmd", b'{"schema":1,"op":"run"}', qos=1)
            await c.publish("dlshare/v1/node/n2/mem", b"dlshare-memory", qos=1)
        for user in ("dlshare-sched", "dlshare-operator"):
            async with _client(acl_broker, user) as c:
                await c.publish("dlshare/v1/node/n2/cmd", user.encode(), qos=1)
        got = []

        async def three() -> None:
            async for msg in n2.messages:
                got.append((str(msg.topic).rsplit("/", 1)[1], bytes(msg.payload)))
                if len(got) == 3:
                    return

        await asyncio.wait_for(three(), 10)
    assert sorted(got) == [("cmd", b"dlshare-operator"), ("cmd", b"dlshare-sched"), ("mem", b"dlshare-memory")], got


async def test_a_connecting_node_gets_no_retained_message_it_may_not_read(acl_broker):
    """Promise: retained messages (every node's, server's and scheduler's state) reach a client only
    through its own subscriptions and its read grants.  amqtt replayed them at connect for every
    filter any session held (here the operator's) and without the ACL's read check: n1 got n2's
    state.  Barrier: n1's own retained command, replayed for its own subscription."""
    async with _client(acl_broker, "dlshare-operator") as op:
        await op.subscribe("dlshare/v1/node/+/state", qos=1)  # held while n1 connects
        await op.subscribe("dlshare/v1/node/+/cmd", qos=1)
        async with _client(acl_broker, "n2") as n2:
            await n2.publish("dlshare/v1/node/n2/state", b'{"schema":1,"status":"online"}', qos=1, retain=True)
        await op.publish("dlshare/v1/node/n1/cmd", b'{"schema":1,"op":"ping"}', qos=1, retain=True)
        # the operator's own subscription sees both, so the broker holds both before n1 connects
        await _received(op, "dlshare/v1/node/n1/cmd")
        try:
            async with _client(acl_broker, "n1") as n1:
                await n1.subscribe("dlshare/v1/node/n1/cmd", qos=1)
                got = await _received(n1, "dlshare/v1/node/n1/cmd")
        finally:
            async with _client(acl_broker, "dlshare-operator") as c:  # leave no retained message behind
                await c.publish("dlshare/v1/node/n1/cmd", b"", qos=1, retain=True)
            async with _client(acl_broker, "n2") as c:
                await c.publish("dlshare/v1/node/n2/state", b"", qos=1, retain=True)
    assert got == ["dlshare/v1/node/n1/cmd"], got


async def test_the_example_files_are_the_ones_documented():
    """Promise: the README's Security section points at the ACL and conf these tests run."""
    readme = (ROOT / "README.md").read_text()
    assert "deploy/mosquitto/dlshare.acl" in readme and "deploy/mosquitto/dlshare.conf" in readme
    assert Path(DEPLOY / "dlshare.acl").is_file()
