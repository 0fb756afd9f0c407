"""tc-shaped links between namespace hosts (nodesvc.netns.HostNet.shape / counters)."""

import subprocess
import sys

import pytest

from nodesvc import netns
from nodesvc.netns import HostNet

reason = netns.shaping_available()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"shaped links unavailable: {reason}")


def test_both_ends_of_every_link_get_a_tbf_and_counters_see_the_bytes():
    hn = HostNet(["a", "b"]).create()
    try:
        hn.shape(200_000_000)
        for h in hn.hosts:
            inside = subprocess.run(["tc", "-n", hn.netns(h), "qdisc", "show", "dev", "eth0"], capture_output=True,
                                    text=True).stdout
            outside = subprocess.run(["tc", "qdisc", "show", "dev", hn.veth(h)], capture_output=True, text=True).stdout
            assert "tbf" in inside and "rate 200Mbit" in inside, inside
            assert "tbf" in outside and "rate 200Mbit" in outside, outside
        before = hn.counters()
        srv = subprocess.Popen(
            [*hn.prefix("a"), sys.executable, "-c",
             f"import socket; s=socket.socket(); s.bind(('{hn.addrs['a']}', 7002)); s.listen(); print('ready', flush=True);"
             "c,_=s.accept(); n=0\nwhile (k := len(c.recv(1 << 20))): n += k\nprint(n)"],
            stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready"
        subprocess.run([*hn.prefix("b"), sys.executable, "-c",
                        f"import socket; c=socket.create_connection(('{hn.addrs['a']}', 7002), timeout=10);"
                        "c.sendall(bytes(3 << 20)); c.close()"], check=True, timeout=60)
        assert int(srv.stdout.readline()) == 3 << 20
        srv.wait(timeout=10)
        after = hn.counters()
        sent_b = after["b"][0] - before["b"][0]
        recv_a = after["a"][1] - before["a"][1]
        assert 3 << 20 < sent_b < (3 << 20) * 1.1 and 3 << 20 < recv_a < (3 << 20) * 1.1  # payload + headers
    finally:
        hn.destroy()
    assert hn.netns("a") not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shaping_probe_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda name: None if name == "tc" else "/usr/sbin/" + name)
    assert "tc command" in netns.shaping_available()
