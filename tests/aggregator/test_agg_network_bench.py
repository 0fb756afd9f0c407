"""`dlshare bench agg --network` refuses clearly where it cannot build shaped hosts."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from nodesvc import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_network_bench_refuses_with_the_reason_when_shaping_is_unavailable(monkeypatch):
    from bench import agg_network

    monkeypatch.setattr(netns, "shaping_available", lambda: "the tc command (iproute2) is needed to shape links")
    ns = argparse.Namespace(quick=True, json=None, network=True, net_rate_mbit=500.0, net_compute_ms=None,
                            net_width=4096)
    with pytest.raises(SystemExit) as ei:
        agg_network.run(ns)
    assert "cannot build shaped hosts here: the tc command (iproute2) is needed" in str(ei.value)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to nobody")
def test_a_user_without_root_gets_a_clear_refusal():
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                        "nodesvc.cli", "bench", "agg", "--network", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "dlshare bench agg --network: cannot build shaped hosts here: network namespaces need root" in r.stderr
