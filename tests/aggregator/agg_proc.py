"""Aggregation servers as real processes (``python -m aggregator.cli``) on fixed ports, restartable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nodesvc.bus.procs import free_port, stop_proc, wait_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


class ServerProc:
    def __init__(self, tmp: Path, sid: str, broker: str = "", round_timeout_s: float = 20.0,
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.sid, self.broker, self.round_timeout_s = sid, broker, round_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = tmp / f"{sid}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProc":
        self.log = open(self.log_path, "ab")
        offset = self.log.tell()  # a restart appends: look for this start's line only
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aggregator.cli", "--listen", self.addr, "--broker", self.broker, "--id", self.sid,
             "--round-timeout-s", str(self.round_timeout_s), "--max-cores", "2"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        wait_port(self.port, proc=self.proc)
        # The port accepts from the moment the server binds; its threads start after the metrics
        # endpoint is up.  A test that counts threads or times the first round waits for this line.
        def started() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aggregation server {self.sid} exited with {self.proc.returncode} "
                                   f"before it started (log: {self.log_path})")
            return b" listening on " in self.log_path.read_bytes()[offset:]

        wait_until(started, 60, f"aggregation server {self.sid} to start (log: {self.log_path})", interval=0.02)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no goodbye to anyone
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_proc(self.proc)
            self.proc = None
            self.log.close()
