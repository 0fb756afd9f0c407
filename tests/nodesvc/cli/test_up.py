"""``dlshare up``: the whole stack as real processes, seen through ``dlshare status``, stopped by SIGINT."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nodesvc.bus.procs import free_port, stop_proc
from tests.conftest import ROOT


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("broker", ["amqtt", "mosquitto"])
def test_up_starts_stack_status_shows_nodes_and_stops_on_sigint(tmp_path, broker):
    port = free_port()
    # Started the way a shell starts a background job (and some CI runners start everything): with
    # SIGINT ignored.  `dlshare up` must still stop on SIGINT; it once relied on Python's default
    # handler, which is not installed then, so this test failed whenever the suite ran in the background.
    p = subprocess.Popen(
        [sys.executable, "-m", "nodesvc.cli", "up", "--nodes", "2", "--broker-listen", f"127.0.0.1:{port}",
         "--broker", broker,
         "--state-dir", str(tmp_path / "up"), "--fake-gpus", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, text=True, preexec_fn=_ignore_sigint,
        env={**os.environ, "DLSHARE_UP_SCHED_LISTEN": f"127.0.0.1:{free_port()}",
             "DLSHARE_UP_AGG_LISTEN": f"127.0.0.1:{free_port()}"})
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "press Ctrl-C" in line:
                break
        out = "".join(lines)
        assert f"mqtt://127.0.0.1:{port}" in out and "node-2" in out, out
        # No anonymous clients: the operator's credentials are in the state directory (mode 0600).
        opfile = tmp_path / "up" / "operator.env"
        assert os.stat(opfile).st_mode & 0o777 == 0o600
        operator = opfile.read_text().strip().partition("=")[2]
        assert operator.startswith("mqtt://dlshare-operator:") and operator.split("@")[0] not in out
        r = subprocess.run([sys.executable, "-m", "nodesvc.cli", "status", "--json"], capture_output=True, text=True,
                           cwd=ROOT, timeout=30, env={**os.environ, "DLSHARE_BROKER": operator})
        doc = json.loads(r.stdout)
        assert {n["node"]: n["status"] for n in doc["nodes"]} == {"node-1": "online", "node-2": "online"}
        assert all(n["gpus"] == 1 for n in doc["nodes"])
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
        assert "stopped" in p.stdout.read()
    finally:
        stop_proc(p)
