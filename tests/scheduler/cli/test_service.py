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
