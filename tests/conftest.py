"""Shared fixtures for the whole suite: real MQTT brokers and real node daemons.

- ``mosquitto``, ``amqtt_broker``, ``broker`` (both, parametrised): a broker process on a
  free loopback port (:class:`BrokerProc`: ``url``, ``stop()``, ``start()`` again on the same port);
- ``node_daemons``: a factory that starts ``dlshare node`` processes (:class:`NodeProc`).

Every process is real, started on free loopback ports and stopped by pid at the end of
the test that asked for it.  Port and waiting helpers come from :mod:`nodesvc.bus.procs`
(``free_port``, ``wait_port``, ``wait_until``, ``until``, ``stop_proc``); import them from there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from nodesvc.bus.procs import free_port, stop_proc, wait_port

# Hypothesis's timing checks (input generation "too slow", a 200 ms deadline an example) measure the
# machine, not the code: on a loaded CI runner one example can wait seconds for a core (a suite run with
# one core held busy failed a Slurm parser's fuzz test on "1 valid input after 6.1 s").  The suite's
# profile turns them off for every test, its own @settings included (they inherit what they do not
# name); the other health checks and every test's example count stay.
settings.register_profile("dlshare-suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("dlshare-suite")

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


class NodeProc:
    """A real ``dlshare node`` daemon process, logging to ``log_path``."""

    def __init__(self, broker_url: str, node_id: str, tmp: Path, args: tuple[str, ...], interval: float,
                 env: Mapping[str, str] | None) -> None:
        self.node_id = node_id
        self.log_path = tmp / f"node-{node_id}.log"
        self.state_dir = tmp / f"state-{node_id}"
        self.argv = [PY, "-m", "nodesvc.cli", "node", "--broker", broker_url, "--node-id", node_id,
                     "--interval", str(interval), "--metrics-listen", "127.0.0.1:0", *args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "DLSHARE_NODE_STATE_DIR": str(self.state_dir),
                     **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill9(self) -> None:
        """SIGKILL, as a crash: the broker publishes the daemon's Last Will."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """A clean stop (it publishes its offline state), killed after ``timeout`` s."""
        stop_proc(self.proc, sig, timeout)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


NodeFactory = Callable[..., NodeProc]


@pytest.fixture
def node_daemons(tmp_path) -> NodeFactory:
    """A factory of real node daemons; every one still running is stopped at the end of the test.

    ``start(broker_url: str, node_id: str, *args: str, interval: float = 0.5,
    env: Mapping[str, str] | None = None) -> NodeProc`` runs
    ``python -m nodesvc.cli node --broker BROKER_URL --node-id NODE_ID --interval INTERVAL
    --metrics-listen 127.0.0.1:0 *ARGS`` from the repository root.  ``args`` come last, so they
    may override those flags (``"--metrics-listen", "127.0.0.1:-1"`` turns metrics off) and add
    others (``"--fake-gpus", "2"``, ``"--allow-run"``, ``"--lend"``).  ``env`` adds to the test's
    environment (config keys as ``DLSHARE_<SECTION>_<KEY>``); the daemon's state directory is
    ``tmp_path/state-NODE_ID`` (``DLSHARE_NODE_STATE_DIR``), its log ``tmp_path/node-NODE_ID.log``
    (:meth:`NodeProc.output`).  It returns at once: wait for the daemon's retained ``online``
    state (or its metrics port) before talking to it.
    """
    started: list[NodeProc] = []

    def start(broker_url: str, node_id: str, *args: str, interval: float = 0.5,
              env: Mapping[str, str] | None = None) -> NodeProc:
        node = NodeProc(broker_url, node_id, tmp_path, args, interval, env)
        started.append(node)
        return node

    yield start
    # Signal them all first, then wait on one deadline: a teardown is bounded whatever the test left.
    for node in started:
        if node.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    for node in started:
        stop_proc(node.proc, timeout=max(0.1, deadline - time.monotonic()))


@pytest.fixture(scope="module")
def local_users():
    """Real local users and groups (``useradd``), removed at the end of the module:
    ``local_users.user(groups=[local_users.group()])`` -> :class:`tests.local_users.LocalUser`."""
    if os.geteuid() != 0:
        pytest.skip("creating users needs root")
    from tests.local_users import LocalUsers

    users = LocalUsers()
    yield users
    users.remove_all()


# `make test` runs the suite on several workers (tests/suite.py: pytest-xdist, three by default, each
# test file on one worker, each worker in its own network namespace and cgroups, tests/isolate.py), then
# the files below alone, one test at a time as before.  A file belongs here when it cannot share the machine with another
# worker's tests; the reason is beside it.
ALONE = {
    # They keep a core busy on purpose: another worker's deadlines would pay for it.
    "tests/test_stress.py": "holds a core busy with the stress tool's pinned loop",
    "tests/bench/test_page_install.py": "its spin modes keep a thread busy on the other core",
    # Their deadlines are a few times the timeout they check; a loaded core would miss them.
    "tests/adversarial/test_agg_server.py": "a refusal within 0.5 s, closes within 2.5-3 s of a 1 s timeout",
    "tests/adversarial/test_slab_server.py": "closes between 0.9 and 4 s, a place within 4 s",
    "tests/adversarial/test_api.py": "a slow client cut off within 6 s",
    "tests/rdma/test_tcp_server.py": "a stalled frame closed within 3 s, a trickled one within 2 s",
    "tests/rdma/test_remote.py": "a reclaim within 5 s, with acks due within its 5 s deadline",
    # Named network namespaces live in /run/netns, whichever namespace a worker runs in, and a stack
    # that starts clears the stale ones it finds.
    "tests/nodesvc/test_netns.py": "named network namespaces",
    "tests/nodesvc/test_netns_shaping.py": "named network namespaces, shaped links",
    "tests/nodesvc/cli/test_up.py": "dlshare up puts its nodes in named network namespaces",
    "tests/aggregator/test_agg_network_bench.py": "the shaped-hosts benchmark (named network namespaces)",
    # pytest-xdist runs one item per node id; schemathesis makes one item per API operation, all under
    # the test function's one node id, so on a worker 1 of the 34 would run.
    "tests/scheduler/service/test_schema.py": "one node id for many items (schemathesis's operations)",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    seen: dict[str, int] = {}
    for item in items:
        rel = Path(str(item.path)).relative_to(ROOT).as_posix()
        if rel in ALONE:
            item.add_marker(pytest.mark.alone)
        else:
            seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    twice = sorted(n for n, k in seen.items() if k > 1)
    if twice:  # pytest-xdist would run one item of each such node id and drop the rest silently
        raise pytest.UsageError(f"several tests share a node id (a worker would run only one): {twice[:5]}; "
                                "put their file in tests/conftest.py's ALONE")


def pytest_configure(config):
    missing = [f for f in ALONE if not (ROOT / f).is_file()]
    if missing:  # a file renamed or removed: its entry would silently stop keeping it alone
        raise pytest.UsageError(f"tests/conftest.py ALONE names files that do not exist: {missing}")
