"""Network namespaces that stand in for separate hosts on one machine.

:class:`HostNet` builds a private bridge with an address in a /24 of
10.199.0.0/16 that no interface here uses yet, and one namespace per
"host" joined to it by a veth pair.  Every process of a host runs in its
namespace (through nsenter); traffic between hosts crosses the veth pairs and the bridge,
never a real network.  Names carry a short run id, and the run's owner pid is
recorded, so a crashed run's leftovers are removed by the next one.

:meth:`HostNet.shape` gives every host a NIC of a given rate: a tbf qdisc on
both ends of its veth pair, one for what the host sends and one for what it
receives, so the bridge behaves as a non-blocking switch between hosts with
that link speed.  :meth:`HostNet.counters` reads the bytes each host sent and
received (from the root side of its veth pair).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("dlshare.netns")

REGISTRY = Path("/run/dlshare-netns")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("nsenter"):
        return "the ip (iproute2) and nsenter (util-linux) commands are needed"
    probe = f"dlsprobe{secrets.token_hex(2)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)}: {r.stderr.strip()}")
    return r


def tbf_args(rate_bit: int) -> list[str]:
    """tbf parameters for a link of ``rate_bit`` bit/s.

    The bucket holds 4 ms of traffic and at least 256 KiB, so a 64 KiB GSO packet always fits; the
    queue holds 20 ms, enough to keep TCP busy on these sub-millisecond paths without a deep buffer.
    """
    burst = max(256 << 10, rate_bit // 8 // 250)
    return ["rate", f"{int(rate_bit)}bit", "burst", str(burst), "latency", "20ms"]


def shaping_available() -> str | None:
    """None when links can be shaped with tc tbf here, else the reason they cannot."""
    reason = available()
    if reason:
        return reason
    if not shutil.which("tc"):
        return "the tc command (iproute2) is needed to shape links"
    a, b = f"dlsq{secrets.token_hex(2)}", f"dlsr{secrets.token_hex(2)}"
    r = _ip("link", "add", a, "type", "veth", "peer", "name", b, check=False)
    if r.returncode != 0:
        return f"cannot make a veth pair: {r.stderr.strip()}"
    try:
        t = _tc("qdisc", "add", "dev", a, "root", "tbf", *tbf_args(10**9), check=False)
        if t.returncode != 0:
            return f"tc cannot add a tbf qdisc (sch_tbf missing?): {t.stderr.strip()}"
    finally:
        _ip("link", "del", a, check=False)
    return None


def _used_subnets() -> set[int]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        for tok in line.split():
            if tok.startswith("10.199."):
                used.add(int(tok.split(".")[2]))
    return used


@dataclass
class HostNet:
    hosts: list[str]
    run: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: int = -1
    addrs: dict[str, str] = field(default_factory=dict)
    created: bool = False

    @property
    def bridge(self) -> str:
        return f"dls{self.run}-br"

    @property
    def gateway(self) -> str:
        """The bridge's address: the root namespace as the hosts see it (broker, services)."""
        return f"10.199.{self.subnet}.1"

    def netns(self, host: str) -> str:
        return f"dls{self.run}-{self.hosts.index(host)}"

    def prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside ``host``.

        nsenter switches only the network namespace; ``ip netns exec`` would also
        remount /sys, hiding the cgroup hierarchies the node daemon enforces with.
        """
        return ["nsenter", f"--net=/run/netns/{self.netns(host)}", "--"]

    def create(self) -> "HostNet":
        cleanup_stale()
        used = _used_subnets()
        self.subnet = next(k for k in range(1, 255) if k not in used)
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / self.run).write_text(json.dumps({"pid": os.getpid(), "hosts": len(self.hosts)}))
        self.created = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.hosts):
                ns, veth = self.netns(host), f"dls{self.run}-v{i}"
                addr = f"10.199.{self.subnet}.{10 + i}"
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.addrs[host] = addr
        except NetnsError:
            self.destroy()
            raise
        log.info("network namespaces for %s on 10.199.%d.0/24", ", ".join(self.hosts), self.subnet)
        return self

    def veth(self, host: str) -> str:
        """The root-namespace end of ``host``'s veth pair."""
        return f"dls{self.run}-v{self.hosts.index(host)}"

    def shape(self, rate_bit: int) -> None:
        """Limit every host's link to ``rate_bit`` bit/s in each direction (tbf on both veth ends)."""
        for host in self.hosts:
            _tc("-n", self.netns(host), "qdisc", "replace", "dev", "eth0", "root", "tbf",
                *tbf_args(rate_bit))  # what the host sends
            _tc("qdisc", "replace", "dev", self.veth(host), "root", "tbf", *tbf_args(rate_bit))  # what it receives

    def counters(self) -> dict[str, tuple[int, int]]:
        """``host -> (bytes sent, bytes received)`` so far, seen from the root end of its veth pair."""
        out = {}
        for host in self.hosts:
            base = Path("/sys/class/net") / self.veth(host) / "statistics"
            rx, tx = int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())
            out[host] = (rx, tx)  # the veth receives what the host sends, and sends what it receives
        return out

    def destroy(self) -> None:
        if not self.created:
            return
        _destroy_run(self.run, len(self.hosts))
        self.created = False


def _destroy_run(run: str, n: int) -> None:
    for i in range(n):
        _ip("link", "del", f"dls{run}-v{i}", check=False)
        _ip("netns", "del", f"dls{run}-{i}", check=False)
    _ip("link", "del", f"dls{run}-br", check=False)
    (REGISTRY / run).unlink(missing_ok=True)


def cleanup_stale() -> int:
    """Remove the namespaces of runs whose owner process is gone; returns how many runs."""
    if not REGISTRY.is_dir():
        return 0
    n = 0
    for f in REGISTRY.iterdir():
        try:
            info = json.loads(f.read_text())
            os.kill(int(info["pid"]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (ValueError, KeyError, OSError):
            info = {"hosts": 16}
        _destroy_run(f.name, int(info.get("hosts", 16)))
        n += 1
    return n
