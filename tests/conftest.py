"""Shared fixtures: real MQTT brokers (mosquitto and the embedded amqtt) on free ports.

Every broker is a real process, started on a free loopback port and stopped
by pid at the end of the test that asked for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodesvc.bus.procs import free_port, stop_proc, wait_port  # noqa: F401  (re-exported for tests)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


class BrokerProc:
    """A broker process that a test may stop and restart on the same port."""

    def __init__(self, kind: str, port: int, tmp: Path) -> None:
        self.kind, self.port, self.tmp = kind, port, tmp
        self.proc: subprocess.Popen | None = None
        self.url = f"mqtt://127.0.0.1:{port}"

    def start(self) -> "BrokerProc":
        if self.kind == "mosquitto":
            conf = self.tmp / f"mosquitto-{self.port}.conf"
            conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                            "set_tcp_nodelay true\n")
            exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
            cmd = [exe, "-c", str(conf)]
        else:
            cmd = [PY, "-m", "nodesvc.cli", "broker", "--listen", f"127.0.0.1:{self.port}"]
        self.log = open(self.tmp / f"{self.kind}-{self.port}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc:
            stop_proc(self.proc)
            self.proc = None
            self.log.close()


def _mosquitto_available() -> bool:
    return bool(shutil.which("mosquitto") or os.path.exists("/usr/sbin/mosquitto"))


@pytest.fixture
def mosquitto(tmp_path):
    if not _mosquitto_available():
        pytest.fail("mosquitto is not installed: run `make deps` (the test command installs it)")
    b = BrokerProc("mosquitto", free_port(), tmp_path).start()
    yield b
    b.stop()


@pytest.fixture
def amqtt_broker(tmp_path):
    b = BrokerProc("amqtt", free_port(), tmp_path).start()
    yield b
    b.stop()


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker(request, tmp_path):
    """Each test that takes ``broker`` runs against both real brokers."""
    if request.param == "mosquitto" and not _mosquitto_available():
        pytest.fail("mosquitto is not installed: run `make deps`")
    b = BrokerProc(request.param, free_port(), tmp_path).start()
    yield b
    b.stop()
