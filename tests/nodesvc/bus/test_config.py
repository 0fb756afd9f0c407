"""Layered configuration (nodesvc.bus.config): defaults < file < environment < flags, and clear errors."""

import pytest

import nodesvc.cli.node  # noqa: F401  (registers the [node] section these tests use)
from nodesvc.bus import config


def test_precedence_file_then_env_then_flags(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[dlshare]\nbroker = "mqtt://file:1"\n[node]\ninterval = 7.0\nid = "from-file"\nfake_gpus = 1\n')
    cfg = config.load(f, env={}, flags={})
    assert cfg["node"]["interval"] == 7.0 and cfg["node"]["id"] == "from-file"
    cfg = config.load(f, env={"DLSHARE_NODE_INTERVAL": "3", "DLSHARE_BROKER": "mqtt://env:2"}, flags={})
    assert cfg["node"]["interval"] == 3.0 and cfg["dlshare"]["broker"] == "mqtt://env:2"
    assert cfg["node"]["id"] == "from-file"
    cfg = config.load(f, env={"DLSHARE_NODE_INTERVAL": "3"}, flags={"node": {"interval": 1.5, "id": None}})
    assert cfg["node"]["interval"] == 1.5 and cfg["node"]["id"] == "from-file"
    assert cfg["node"]["fake_gpus"] == 1


@pytest.mark.parametrize("text,needle", [
    ("[node]\ninterval = 'fast'\n", "node.interval"),
    ("[node]\nbogus = 1\n", "unknown key node.bogus"),
    ("[nosuch]\nx = 1\n", "unknown section [nosuch]"),
    ("[node\n", "config file"),
    ("[node]\nlend = 1\n", "expected bool"),
])
def test_bad_config_files_name_the_problem(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError, match=None) as ei:
        config.load(f, env={})
    assert needle in str(ei.value)


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load("/nonexistent/dlshare.toml", env={})
