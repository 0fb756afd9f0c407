import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.cli import status
from nodesvc import telemetry
from nodesvc.gpu import GpuProbe, SimulatedNvml
from tests.conftest import ROOT, free_port, stop_proc

PSI = """some avg10=1.50 avg60=0.25 avg300=0.05 total=123456
full avg10=0.10 avg60=0.00 avg300=0.00 total=789
"""


def test_parse_psi():
    p = telemetry.parse_psi(PSI)
    assert p["some_avg10"] == 1.5 and p["some_total_us"] == 123456 and p["full_total_us"] == 789


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_parse_psi_garbage_raises_value_error_only(text):
    try:
        out = telemetry.parse_psi(text)
    except ValueError:
        return
    assert all(k.startswith(("some_", "full_")) for k in out)


def test_read_psi_missing_file_reports_reason(tmp_path):
    assert "reason" in telemetry.read_psi("memory", root=str(tmp_path))


def test_rdma_devices_from_sysfs_tree(tmp_path):
    none = telemetry.rdma_devices(str(tmp_path / "absent"))
    assert none["devices"] == [] and "does not exist" in none["reason"]
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    got = telemetry.rdma_devices(str(tmp_path / "ib"))
    assert got["devices"][0]["name"] == "mlx5_0"
    assert got["devices"][0]["ports"] == [{"port": "1", "state": "4: ACTIVE", "rate": "100 Gb/sec (4X EDR)"}]


def test_gpu_probe_without_nvml_library_says_why():
    g = GpuProbe()  # the real pynvml path; this machine has no NVIDIA driver
    s = g.sample()
    if s["devices"]:
        pytest.skip("this machine has a GPU")  # the GPU machine: covered by test_gpu_probe_simulated
    assert s["reason"] and ("NVML" in s["reason"] or "pynvml" in s["reason"])


def test_gpu_probe_broken_init_reports_reason():
    class Broken(SimulatedNvml):
        def nvmlInit(self):
            raise RuntimeError("Driver Not Loaded")

    s = GpuProbe(Broken(2)).sample()
    assert s["devices"] == [] and "Driver Not Loaded" in s["reason"]


def test_gpu_probe_reads_every_field_through_the_nvml_interface():
    load = {0: (80.0, [111]), 1: (0.0, [])}
    s = GpuProbe(SimulatedNvml(2, memory_bytes=32 << 30, load=lambda i: load[i])).sample()
    d0, d1 = s["devices"]
    assert s["simulated"] is True and s["reason"] is None
    assert d0["util_percent"] == 80 and d1["util_percent"] == 0
    assert d0["memory_total_bytes"] == 32 << 30 and d0["memory_used_bytes"] > 0
    assert d0["processes"] == [{"pid": 111, "memory_used_bytes": 2 << 30}]
    assert d0["power_w"] > d1["power_w"] and d0["sm_clock_mhz"] > 0


def test_gpu_probe_tolerates_unsupported_fields():
    class Partial(SimulatedNvml):
        def nvmlDeviceGetPowerUsage(self, h):
            raise RuntimeError("Not Supported")

    d = GpuProbe(Partial(1)).sample()["devices"][0]
    assert d["power_w"] is None and d["util_percent"] == 0


def test_summarize_status_document():
    states = {
        "dlshare/v1/node/a/state": {"status": "online", "ts": time.time(), "summary": {
            "cpu_count": 8, "cpu_percent": 10.0, "memory_total_bytes": 64 << 30, "memory_available_bytes": 40 << 30,
            "gpus": 4, "gpu_util_percent": [1, 2, 3, 4], "jobs_running": 2,
            "donor": {"lendable_bytes": 8 << 30, "lent_bytes": 2 << 30, "lent_to": {"b": 2 << 30}}}},
        "dlshare/v1/node/b/state": {"status": "offline", "reason": "connection lost"},
        "dlshare/v1/agg/s1/state": {"status": "online", "summary": {"cores": 2, "min_cores": 1, "max_cores": 8,
                                                                   "busy": 0.5, "jobs": ["j1"]}},
        "garbage/topic": {"status": "online"},
    }
    doc = status.summarize(states)
    assert [n["node"] for n in doc["nodes"]] == ["a", "b"]
    a, b = doc["nodes"]
    assert a["lent_bytes"] == 2 << 30 and b["borrowed_bytes"] == 2 << 30 and a["borrowed_bytes"] == 0
    assert b["status"] == "offline" and b["reason"] == "connection lost"
    assert doc["aggregators"][0]["cores"] == 2
    from rich.console import Console

    c = Console(record=True, width=160)
    status.render(doc, c)
    text = c.export_text()
    assert "online" in text and "offline" in text and "aggregation servers" in text


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
        r = subprocess.run([sys.executable, "-m", "nodesvc.cli", "status", "--json", "--broker",
                            f"mqtt://127.0.0.1:{port}"], capture_output=True, text=True, cwd=ROOT, timeout=30)
        doc = json.loads(r.stdout)
        assert {n["node"]: n["status"] for n in doc["nodes"]} == {"node-1": "online", "node-2": "online"}
        assert all(n["gpus"] == 1 for n in doc["nodes"])
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
        assert "stopped" in p.stdout.read()
    finally:
        stop_proc(p)
