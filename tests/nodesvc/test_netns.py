import json
import subprocess
import sys

import pytest

from nodesvc import netns
from nodesvc.netns import REGISTRY, HostNet

reason = netns.available()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"network namespaces unavailable: {reason}")


def _names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_reach_each_other_over_the_bridge_and_teardown_is_complete():
    hn = HostNet(["a", "b"]).create()
    try:
        server = subprocess.Popen(
            [*hn.prefix("a"), sys.executable, "-c",
             f"import socket; s=socket.socket(); s.bind(('{hn.addrs['a']}', 7001)); s.listen();"
             "print('ready', flush=True); c,_=s.accept(); c.sendall(c.recv(64)[::-1])"],
            stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [*hn.prefix("b"), sys.executable, "-c",
             f"import socket; c=socket.create_connection(('{hn.addrs['a']}', 7001), timeout=5); c.sendall(b'abc');"
             "print(c.recv(64).decode(), c.getsockname()[0])"],
            capture_output=True, text=True, timeout=20).stdout.split()
        assert out == ["cba", hn.addrs["b"]]  # it really came from host b's address
        server.wait(timeout=5)
        # the root namespace (broker, services) is reachable at the gateway
        assert subprocess.run([*hn.prefix("a"), "ip", "-4", "addr", "show", "eth0"], capture_output=True,
                              text=True).stdout.count(hn.addrs["a"]) == 1
    finally:
        hn.destroy()
    assert hn.netns("a") not in _names()
    assert not (REGISTRY / hn.run).exists()


def test_stale_runs_of_dead_owners_are_removed():
    hn = HostNet(["x"]).create()
    (REGISTRY / hn.run).write_text(json.dumps({"pid": 2**22 + 12345, "hosts": 1}))  # an owner that is gone
    hn.created = False  # as if the owner crashed without cleaning up
    assert hn.netns("x") in _names()
    assert netns.cleanup_stale() >= 1
    assert hn.netns("x") not in _names()
