"""What importing the package loads: the client and the DDP hook (floor 1) never pull in the server (floor 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aggregator


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in sys.modules if m.startswith(('aggregator', 'nodesvc'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize("code", ["import aggregator", "from aggregator import Client",
                                  "from aggregator.torch import AggState, comm_hook"])
def test_client_and_hook_do_not_load_the_server(code):
    loaded = _loaded_after(code)
    assert "aggregator.client" in loaded
    assert not loaded & {"aggregator.server", "aggregator.pool", "aggregator.cli", "nodesvc.bus.mqtt"}, loaded


def test_server_names_load_on_first_use():
    loaded = _loaded_after("from aggregator import AggregationServer, serve")
    assert "aggregator.server" in loaded
    assert {"AggregationServer", "serve", "Client"} <= set(dir(aggregator))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aggregator.nope  # noqa: B018
