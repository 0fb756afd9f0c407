import subprocess
import sys
import tomllib

import pytest

from nodesvc.bus import config
from nodesvc.cli import main
import nodesvc.cli.node  # noqa: F401  (registers the [node] section)

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


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


def test_bad_env_is_an_error_and_cli_exits_2(capsys, monkeypatch):
    with pytest.raises(config.ConfigError, match="DLSHARE_NODE_INTERVAL"):
        config.load(None, env={"DLSHARE_NODE_INTERVAL": "soon"})
    monkeypatch.setenv("DLSHARE_NODE_FAKE_GPUS", "many")
    assert main(["node", "--print-config"]) == 2
    assert "DLSHARE_NODE_FAKE_GPUS" in capsys.readouterr().err


def test_missing_config_file():
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load("/nonexistent/dlshare.toml", env={})


def test_version():
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.startswith("dlshare ")


def test_log_json_writes_one_json_object_a_line(tmp_path):
    from tests.conftest import free_port

    port = free_port()  # nothing listens there: the daemon logs its retries
    p = subprocess.Popen([sys.executable, "-m", "nodesvc.cli", "node", "--log-json", "--node-id", "lj",
                          "--broker", f"mqtt://127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0"],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**__import__("os").environ, "DLSHARE_NODE_STATE_DIR": str(tmp_path)})
    try:
        lines = []
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("unreachable" in line for line in lines):
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        p.terminate()
        p.wait(timeout=10)
    import json

    objs = [json.loads(line) for line in lines]
    assert objs and all({"ts", "level", "logger", "msg"} <= o.keys() for o in objs)
    assert any(o["level"] == "warning" and "unreachable" in o["msg"] for o in objs)
