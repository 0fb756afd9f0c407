"""`dlshare agg drain ID` against real server processes and a real broker, with training going on."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.aggregator.agg_proc import ROOT, ServerProc
from aggregator import Client
from nodesvc.bus.procs import wait_until

FAST = {"DLSHARE_AGG_TELEMETRY_INTERVAL_S": "0.3"}


def _status(broker: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "status", "--json", "--broker", broker],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {a["server"]: a for a in json.loads(out.stdout)["aggregators"]}


def test_drain_waits_for_every_rank_then_the_server_gets_nothing_new(mosquitto, tmp_path):
    a = ServerProc(tmp_path, "drA", broker=mosquitto.url, env=FAST).start()
    b = ServerProc(tmp_path, "drB", broker=mosquitto.url, env=FAST).start()
    world, n = 2, 200_000
    clients = [Client([a.addr, b.addr], "dj", r, world, chunk_bytes=16 << 10) for r in range(world)]
    rnd = [0]

    def round_all() -> None:
        xs = [np.full(n, float(r + 1 + rnd[0]), np.float32) for r in range(world)]
        futs = [c.allreduce_async(x, op="sum", round=rnd[0]) for c, x in zip(clients, xs)]
        for f, x in zip(futs, xs):
            f.result(timeout=30)
            assert np.all(x == 3 + 2 * rnd[0])
        rnd[0] += 1

    cli = None
    try:
        wait_until(lambda: {"drA", "drB"} <= set(_status(mosquitto.url)), timeout=30, what="both servers online")
        for _ in range(3):
            round_all()
        sent = [c.stats()["servers"][a.addr]["bytes_sent"] for c in clients]
        assert all(s > 0 for s in sent)
        # Training pauses between rounds: no rank has moved past the drain yet, so the command waits.
        cli = subprocess.Popen([sys.executable, "-m", "nodesvc.cli", "agg", "drain", "drA", "--broker",
                                mosquitto.url, "--wait-timeout", "60"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        first = cli.stdout.readline()
        assert "drA: draining" in first and "'dj': [0, 1]" in first, first
        wait_until(lambda: _status(mosquitto.url)["drA"]["draining"], timeout=30, what="status shows draining")
        assert cli.poll() is None
        # One more round: each rank starts a round past the drain (routed to drB) and says so.
        round_all()
        out, _ = cli.communicate(timeout=60)
        assert cli.returncode == 0, first + out
        assert "drA: drained in" in out and "jobs still connected: dj" in out
        for _ in range(3):
            round_all()
        assert [c.stats()["servers"][a.addr]["bytes_sent"] for c in clients] == sent  # nothing new went there
        assert all(c.stats()["servers"][a.addr]["draining_from"] == 3 for c in clients)
        st = wait_until(lambda: (s := _status(mosquitto.url)["drA"])["drained"] and s, timeout=30,
                        what="status shows drained")
        assert st["status"] == "online" and st["draining"]
        assert not _status(mosquitto.url)["drB"]["draining"]
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.wait()
        for c in clients:
            c.close()
        a.stop()
        b.stop()


def test_drain_of_a_server_nobody_answers_for_fails_clearly(mosquitto):
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "agg", "drain", "nosuch", "--broker", mosquitto.url,
                          "--reply-timeout", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "drain to nosuch: no reply within 1.5s" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "agg", "drain", "--broker", mosquitto.url],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "name the aggregation server to drain" in out.stderr


def test_status_shows_draining_and_drained_and_ignores_malformed_flags():
    from nodesvc.cli.status import render, summarize

    doc = summarize({
        "dlshare/v1/agg/a0/state": {"status": "online", "summary": {"draining": True, "drained": False}},
        "dlshare/v1/agg/a1/state": {"status": "online", "summary": {"draining": True, "drained": True}},
        "dlshare/v1/agg/a2/state": {"status": "online", "summary": {"draining": "yes", "drained": 1}},
    })
    got = {a["server"]: (a["draining"], a["drained"]) for a in doc["aggregators"]}
    assert got == {"a0": (True, False), "a1": (True, True), "a2": (False, False)}
    from rich.console import Console

    con = Console(record=True, width=120)
    render(doc, con)
    text = con.export_text()
    assert "online (draining)" in text and "online (drained)" in text
