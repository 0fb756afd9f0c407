"""The ``dlshare`` command line (nodesvc.cli): config layers end to end, errors, version, log format."""

import json
import subprocess
import sys
import tomllib

import pytest

import nodesvc.cli.node  # noqa: F401  (registers the [node] section)
from nodesvc.bus import config
from nodesvc.bus.procs import free_port, wait_until
from nodesvc.cli import main
from tests.conftest import ROOT


def test_cli_print_config_applies_all_layers(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[node]\ninterval = 7.0\nid = "file-id"\nlend = false\n')
    env = {"PATH": "/usr/bin:/bin", "DLSHARE_NODE_ID": "env-id", "DLSHARE_NODE_LEND": "yes"}
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "node", "--config", str(f), "--interval", "2",
                          "--print-config"], capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    cfg = tomllib.loads(out)
    assert cfg["node"]["interval"] == 2.0  # flag beats file
    assert cfg["node"]["id"] == "env-id"  # env beats file
    assert cfg["node"]["lend"] is True
    # the printed config is itself a valid config file
    again = tmp_path / "again.toml"
    again.write_text(out)
    assert config.load(again, env={})["node"] == cfg["node"]


def test_bad_env_is_an_error_and_cli_exits_2(capsys, monkeypatch):
    with pytest.raises(config.ConfigError, match="DLSHARE_NODE_INTERVAL"):
        config.load(None, env={"DLSHARE_NODE_INTERVAL": "soon"})
    monkeypatch.setenv("DLSHARE_NODE_FAKE_GPUS", "many")
    assert main(["node", "--print-config"]) == 2
    assert "DLSHARE_NODE_FAKE_GPUS" in capsys.readouterr().err


def test_version():
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.startswith("dlshare ")


def test_log_json_writes_one_json_object_a_line(node_daemons):
    port = free_port()  # nothing listens there: the daemon logs its retries
    p = node_daemons(f"mqtt://127.0.0.1:{port}", "lj", "--log-json")
    wait_until(lambda: "unreachable" in p.output(), timeout=20, what="the daemon to log a failed connection")
    p.stop()
    objs = [json.loads(line) for line in p.output().splitlines()]
    assert objs and all({"ts", "level", "logger", "msg"} <= o.keys() for o in objs)
    assert any(o["level"] == "warning" and "unreachable" in o["msg"] for o in objs)
