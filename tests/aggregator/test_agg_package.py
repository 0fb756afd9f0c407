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


@pytest.mark.parametrize("code", ["from aggregator import Client", "from aggregator.torch import AggState, comm_hook"])
def test_client_and_hook_do_not_load_the_server(code):
    loaded = _loaded_after(code)
    assert "aggregator.client" in loaded
    assert not loaded & {"aggregator.server", "aggregator.pool", "aggregator.cli", "nodesvc.bus.mqtt"}, loaded


@pytest.mark.parametrize("code", ["import aggregator",
                                  "import aggregator.settings\nfrom nodesvc.bus import config\n"
                                  "assert 'agg' in config.defaults()",
                                  "import aggregator.cli\nfrom nodesvc.bus import config\n"
                                  "assert 'agg' in config.defaults()"])
def test_the_package_its_settings_and_its_command_load_neither_client_nor_server(code):
    """The ``[agg]`` config section must be known to every ``dlshare`` command (one config file serves
    them all); loading it costs them neither the client (numpy, the C extension) nor the server."""
    loaded = _loaded_after(code)
    assert not loaded & {"aggregator.client", "aggregator.server", "aggregator.pool"}, loaded


def test_server_names_load_on_first_use():
    loaded = _loaded_after("from aggregator import AggregationServer, serve")
    assert "aggregator.server" in loaded
    assert {"AggregationServer", "serve", "Client"} <= set(dir(aggregator))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        aggregator.nope  # noqa: B018


def test_a_link_uses_only_what_its_owner_protocol_names_and_the_client_has_all_of_it():
    """``ServerLink`` is wired to its client by the narrow ``LinkOwner`` interface, not the whole client."""
    import ast
    import typing

    from aggregator import Client
    from aggregator.link import LinkOwner
    from tests.conftest import ROOT

    members = set(typing.get_type_hints(LinkOwner)) | {
        n for n, v in vars(LinkOwner).items() if callable(v) and not n.startswith("_")}
    used = set()
    tree = ast.parse((ROOT / "aggregator" / "link.py").read_text())
    for node in ast.walk(tree):
        # self.client.X, and c.X where c = self.client
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "client":
            used.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "c":
            used.add(node.attr)
    assert used and used <= members, f"link.py uses client members its protocol does not name: {used - members}"
    c = Client(["127.0.0.1:1"], "j", 0, 1)
    try:
        missing = [m for m in members if not hasattr(c, m)]
        assert not missing, f"Client lacks {missing}"
    finally:
        c.close()


def test_server_settings_come_from_the_config_in_one_object():
    from aggregator.server import ServerSettings
    from nodesvc.bus import config

    cfg = config.load(env={}, flags={"agg": {"listen": "127.0.0.1:7799", "id": "s9", "max_cores": 3,
                                             "hello_timeout_s": 2.5, "trace_file": "/tmp/x.json"}})
    st = ServerSettings.from_config(cfg)
    assert (st.host, st.port, st.server_id, st.max_cores, st.hello_timeout_s, st.trace) == \
        ("127.0.0.1", 7799, "s9", 3, 2.5, True)
    bad = config.load(env={}, flags={"agg": {"round_timeout_s": -1.0}})
    with pytest.raises(config.ConfigError, match="round_timeout_s"):
        ServerSettings.from_config(bad)
    for port in ("\u00b2", "\u0663", "x", "--1"):  # "²" and an Arabic-Indic 3 are str.isdigit() but no port
        bad = config.load(env={}, flags={"agg": {"metrics_listen": f"127.0.0.1:{port}"}})
        with pytest.raises(config.ConfigError, match="metrics_listen"):
            ServerSettings.from_config(bad)
