"""``dlshare node drain ID``: an operator takes back everything a donor lends, with real donor daemons,
a real consumer holding data on them, and a real broker."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from nodesvc.bus.procs import wait_until
from tests.rdma.donors import ROOT, SLAB


def _drain(broker: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodesvc.cli", "node", "drain", *args, "--broker", broker],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_drain_moves_every_copy_off_the_donor_and_it_lends_nothing_while_paused(mosquitto, donor_factory,
                                                                                consumer_factory, control_factory):
    donor_factory(mosquitto.url, 3, deadline_s=20.0)
    mem = consumer_factory(mosquitto.url, 3, replicas=2, seed=3)
    ctl = control_factory(mosquitto.url)
    buf = mem.alloc(4 * SLAB)
    data = np.random.default_rng(5).integers(0, 256, len(buf), dtype=np.uint8)
    buf.write(0, data)
    counts: dict[str, int] = {}
    for e in buf.extents:
        for r in e.replicas:
            counts[r.node] = counts.get(r.node, 0) + 1
    victim = max(counts, key=counts.get)
    out = _drain(mosquitto.url, victim, "--pause", "120")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{victim}: drained in" in out.stdout and "nothing lent; lending paused for 120 s" in out.stdout, out.stdout
    st = ctl.call(victim, "donor_status", {})
    assert st["slabs"] == [] and st["stats"]["forced_unmaps"] == 0  # moved by the consumer, none taken by force
    # the copies live on the other donors, and every byte is still there
    wait_until(lambda: all(len([r for r in e.replicas if r.node != victim]) == 2 for e in buf.extents), 30,
               "two copies of every extent elsewhere")
    assert victim not in {r.node for e in buf.extents for r in e.replicas}
    assert np.array_equal(buf.read(0, len(buf)), data)
    # paused: a new map there is refused, with the reason
    refused = _map_error(ctl, victim)
    assert "paused" in refused, refused


def _map_error(ctl, node: str) -> str:
    from nodesvc.bus.rpc import CommandError

    try:
        ctl.call(node, "map", {"consumer": "someone", "lease_s": 30.0})
    except CommandError as exc:
        return str(exc)
    return "mapped"


def test_drain_of_a_node_that_does_not_answer_or_refuses_fails_clearly(mosquitto, donor_factory, control_factory):
    from nodesvc.bus.rpc import CommandError

    (donor,) = donor_factory(mosquitto.url, 1)
    ctl = control_factory(mosquitto.url)
    wait_until(lambda: "slabs" in ctl.call(donor.node, "donor_status", {}, timeout=2.0), 60, "the donor answering",
               ignore=(CommandError,))
    out = _drain(mosquitto.url, "nosuch", "--reply-timeout", "1.5")
    assert out.returncode == 1 and "dlshare node drain: reclaim to nosuch: no reply within 1.5s" in out.stderr, \
        out.stderr
    out = _drain(mosquitto.url)
    assert out.returncode == 2 and "name the donor node to drain" in out.stderr
    out = _drain(mosquitto.url, donor.node, "--pause", "200000")
    assert out.returncode == 1 and "pause_s" in out.stderr, out.stderr  # over a day: the node itself refuses
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "node", "n1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'n1'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "node", "run", "n1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "did you mean `dlshare node drain n1`" in out.stderr
