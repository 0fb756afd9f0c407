"""Fixtures of the adversarial suite: a slab server with short timeouts, one real node daemon
(mosquitto, cgroup enforcement, lending) shared by a module's attacks, and the scheduler service
as a real process with small limits.  Brokers and daemons are module-scoped: every attack
that leaves them alive (the point of most of them) lets the next one reuse them."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nodesvc.bus.procs import free_port, stop_proc, wait_port

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture
def slab_server():
    """``slab_server(**SlabServer options)``: a slab server with one 1 MiB slab (id 1); returns
    ``(server, token)``.  Defaults: 1 s idle window, 0.5 s frame timeout."""
    from rdma.slab_memory import SlabMemory
    from rdma.slab_server import SlabServer
    from rdma.slab_token import random_token

    made = []

    def start(**kw):
        kw.setdefault("idle_timeout_s", 1.0)
        kw.setdefault("frame_timeout_s", 0.5)
        srv = SlabServer("127.0.0.1", 0, **kw)
        reg = SlabMemory(1 << 20)
        tok = random_token()
        srv.add_slab(1, reg, tok)
        made.append((srv, reg))
        return srv, tok

    yield start
    for srv, reg in made:
        srv.stop()
        reg.release()


@pytest.fixture(scope="module")
def module_mosquitto(tmp_path_factory):
    """A mosquitto broker for the whole module (mqtt URL)."""
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not os.path.exists(exe):
        pytest.fail("mosquitto is not installed: run `make deps`")
    tmp = tmp_path_factory.mktemp("broker")
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    with open(tmp / "mosquitto.log", "ab") as log:
        proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, proc=proc)
    yield f"mqtt://127.0.0.1:{port}"
    stop_proc(proc)


async def wait_ping(url: str, node: str, timeout: float = 30.0) -> None:
    """Until ``node`` answers a ping on the broker at ``url``."""
    from nodesvc.bus.rpc import CommandError, NodeClient

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with NodeClient(url) as c:
        while True:
            try:
                await c.call(node, "ping", timeout=2)
                return
            except CommandError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)
