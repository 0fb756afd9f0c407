"""`dlshare job submit|list|show|events|cancel` and `dlshare sched --print-config`, as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.scheduler.service.svc_helpers import ROOT, TOKEN, SchedProc


def _dlshare(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodesvc.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_sched_print_config_has_the_section():
    r = _dlshare("sched", "--print-config", "--listen", "0.0.0.0:9999")
    assert r.returncode == 0, r.stderr
    assert "[sched]" in r.stdout and 'listen = "0.0.0.0:9999"' in r.stdout and "profile = " in r.stdout


def test_job_cli_round_trip(mosquitto, tmp_path):
    sched = SchedProc(tmp_path, mosquitto.url).start()
    try:
        env = {"DLSHARE_SCHED_URL": sched.url, "DLSHARE_SCHED_TOKEN": TOKEN}
        r = _dlshare("job", "submit", "--id", "cli-1", "--gpus", "1", "--model", "resnet50", "--cpus", "2",
                     "--memory", "2GiB", "--env", "A=b", "--", "python", "train.py", "--epochs", "3", env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["cli-1", "queued"]
        r = _dlshare("job", "--json", "show", "cli-1", env=env)
        job = json.loads(r.stdout)
        assert job["spec"]["command"] == ["python", "train.py", "--epochs", "3"]
        assert job["spec"]["memory_bytes"] == 2 << 30 and job["spec"]["env"] == {"A": "b"}
        r = _dlshare("job", "list", env=env)
        assert "cli-1" in r.stdout and "queued" in r.stdout
        r = _dlshare("job", "submit", "--gpus", "1", "--cpus", "0", "--", "x", env=env)
        assert r.returncode == 1 and "422" in r.stderr and "cpus" in r.stderr
        r = _dlshare("job", "cancel", "cli-1", env=env)
        assert r.stdout.split() == ["cli-1", "cancelled"]
        r = _dlshare("job", "events", "cli-1", env=env)
        assert "submitted" in r.stdout and "cancelled" in r.stdout
        r = _dlshare("job", "list", env={"DLSHARE_SCHED_URL": sched.url, "DLSHARE_SCHED_TOKEN": "wrong"})
        assert r.returncode == 1 and "401" in r.stderr
    finally:
        sched.stop()


def test_status_shows_the_schedulers_url_and_its_queue(mosquitto, tmp_path):
    """The service's retained state carries where its API listens and how many jobs wait and run;
    `dlshare status` shows both (they were '-' before), and the counts follow the queue."""
    import asyncio

    from nodesvc.bus.procs import wait_until
    from nodesvc.cli import status

    def row():
        doc = status.summarize(asyncio.run(status.gather(mosquitto.url)))
        return next((s for s in doc["schedulers"] if s["status"] == "online"), None)

    sched = SchedProc(tmp_path, mosquitto.url).start()
    try:
        first = wait_until(row, 30, "the scheduler online in dlshare status")
        assert first["url"] == sched.url, first
        env = {"DLSHARE_SCHED_URL": sched.url, "DLSHARE_SCHED_TOKEN": TOKEN}
        for i in range(2):  # no node: both wait
            r = _dlshare("job", "submit", "--id", f"st-{i}", "--gpus", "1", "--", "x", env=env)
            assert r.returncode == 0, r.stderr
        wait_until(lambda: (s := row()) and s["jobs"] == {"waiting": 2, "running": 0}, 30,
                   "the status showing two jobs waiting")
        assert _dlshare("job", "cancel", "st-0", env=env).returncode == 0
        wait_until(lambda: (s := row()) and s["jobs"] == {"waiting": 1, "running": 0}, 30,
                   "the status following the cancel")
        out = _dlshare("status", "--broker", mosquitto.url)
        assert out.returncode == 0 and sched.url in out.stdout and "1 waiting, 0 running" in out.stdout, out.stdout
    finally:
        sched.stop()


def test_the_api_url_names_this_host_for_a_wildcard_listen_address():
    import socket

    from scheduler.cli.service import api_url

    assert api_url("127.0.0.1", 7800) == "http://127.0.0.1:7800"
    assert api_url("0.0.0.0", 7800) == api_url("::", 7800) == f"http://{socket.gethostname()}:7800"
    assert api_url("::1", 9000) == "http://[::1]:9000"
