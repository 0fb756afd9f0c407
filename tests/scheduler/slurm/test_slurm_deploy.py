"""deploy/slurm: the TaskProlog's binding, the example config, the unit file, the lua plugin's table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "slurm"


def prolog(tmp_path, admin_comment: str, node: str = "n2") -> str:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=7 JobName=x'\necho '   AdminComment={admin_comment} '\n"
                                   "echo '   Comment=model=LM'\n")
    (fake / "scontrol").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": node}
    out = subprocess.run(["sh", str(DEPLOY / "dlshare-taskprolog.sh")], env=env, capture_output=True, text=True,
                         timeout=10)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_taskprolog_exports_this_nodes_gpus(tmp_path):
    assert prolog(tmp_path, "dlshare n1=0,1 n2=3") == "export CUDA_VISIBLE_DEVICES=3\nexport DLSHARE_GPUS=3\n"
    assert prolog(tmp_path, "dlshare n1=0,1 n2=3", node="n1").startswith("export CUDA_VISIBLE_DEVICES=0,1\n")
    assert prolog(tmp_path, "dlshare n1=0", node="n3") == ""  # not placed here
    assert prolog(tmp_path, "someone else's note n2=1") == ""  # not dlshare's comment
    assert prolog(tmp_path, "dlshare n2=1;touch${IFS}/tmp/x") == ""  # only digits and commas are exported


def test_example_config_is_what_the_command_reads():
    out = subprocess.run([sys.executable, "-m", "nodesvc.cli", "slurm", "--config", str(DEPLOY / "dlshare-slurm.toml"),
                          "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HOME": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert 'journal = "/var/lib/dlshare/slurm-dlshare.journal"' in out.stdout and "gpu_slots = 2" in out.stdout


def test_unit_and_fragments_agree():
    unit = (DEPLOY / "dlshare-slurm.service").read_text()
    assert "ExecStart=/opt/dlshare/.venv/bin/dlshare slurm --config /etc/dlshare-slurm.toml" in unit
    assert "Restart=always" in unit
    conf = (DEPLOY / "slurm.conf.dlshare").read_text()
    gres = (DEPLOY / "gres.conf.dlshare").read_text()
    assert "JobSubmitPlugins=lua" in conf and "TaskProlog=/etc/slurm/dlshare-taskprolog.sh" in conf
    # 4 devices listed twice = the 8 gpu slots the node line declares
    assert gres.count("Name=gpu File=/dev/nvidia[0-3]") == 2 and "Gres=gpu:8" in conf
    lua = (DEPLOY / "job_submit.lua").read_text()
    assert "{ dlshare = true }" in lua  # the testbed rewrites exactly this table for its partition
