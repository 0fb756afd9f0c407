"""`dlshare sim` as a subprocess: policies on a trace, the predictor check, bad input."""

import json
import subprocess
import sys
from pathlib import Path

from scheduler import data

ROOT = Path(__file__).resolve().parents[3]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "nodesvc.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_sim_writes_json(tmp_path):
    out = tmp_path / "r.json"
    p = run_cli("sim", "--trace", "static_100job", "--cluster", "4x8:24:500", "--profile", "fifo,synergy",
                "--json", str(out))
    assert p.returncode == 0, p.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["fifo", "synergy"]
    assert runs[1]["avg_jct_h"] < runs[0]["avg_jct_h"]  # tuning helps on Synergy's own trace
    assert "| static_100job |" in p.stdout


def test_cli_sim_bad_trace_names_the_row(tmp_path):
    t = tmp_path / "t.csv"
    t.write_text("job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s\n0,0,Nope,1,1,1,1\n")
    p = run_cli("sim", "--trace", str(t), "--profile", "fifo")
    assert p.returncode == 2 and "row 2: unknown model" in p.stderr


def test_cli_sim_predictor(tmp_path):
    src = data.path("iadeep/colocation_util.csv").read_text().splitlines()
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    train.write_text("\n".join(src[:80]) + "\n")
    test.write_text("\n".join([src[0], *src[80:]]) + "\n")
    out = tmp_path / "p.json"
    p = run_cli("sim", "predictor", "--train", str(train), "--test", str(test), "--json", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["train_rows"] == 79 and res["test_rows"] == 26 and res["mape"] > 0


def test_cli_sim_synthetic_trace():
    p = run_cli("sim", "--synthetic", "300", "--cluster", "4x4", "--profile", "fifo,dlshare")
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("| synthetic-300 |")]
    assert len(lines) == 2
