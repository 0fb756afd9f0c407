"""A real Slurm for the Slurm shell's integration tests: munge, one slurmctld, three slurmd.

One cluster per test session (it starts in about a second): each slurmd is ``slurmd -N nX`` on its
own port of this host (Debian's multiple-slurmd build), 4 GPUs each declared twice in gres.conf
(dlshare's co-location slots), short timers.  Every daemon is a child of the test process and is
stopped by its pid at the end.  Each test gets the partition empty and every node up.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scheduler import Predictors, SchedulerState, load_profile
from scheduler.predictors.sensitivity import SensitivityModel
from scheduler.slurm import testbed
from scheduler.slurm.runner import SlurmCLI
from scheduler.slurm.shell import SlurmShell


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = testbed.available()
    if missing:
        pytest.fail(f"Slurm is not installed ({missing}): run `make deps` (APT_PKGS has slurm-wlm and munge)")
    cluster = testbed.LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=3, gpus=4, cpus=12, memory_mb=256000,
                                 gpu_slots=2)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster with its partition empty and every node up (a fault test may have stopped some)."""
    c = slurm_cluster
    if c.ctld is None or c.ctld.poll() is not None:
        c.start_ctld()
    for name in c.names:
        if name not in c.slurmd or c.slurmd[name].poll() is not None:
            c.start_node(name)
    c.cancel_all()
    c.wait_idle()
    c.wait_nodes(lambda st: set(st.values()) <= {"idle"}, timeout=90)
    yield c
    c.cancel_all()


def profile_file(tmp_path: Path, text: str):
    p = tmp_path / "profile.toml"
    p.write_text(text)
    return load_profile(p)


def make_shell(cluster, tmp_path: Path, profile="fifo", **kw) -> SlurmShell:
    """An in-process shell on the cluster's partition (the test drives its steps)."""
    if isinstance(profile, str) and "\n" in profile:
        profile = profile_file(tmp_path, profile)
    core = SchedulerState(profile, predictors=Predictors(sensitivity=SensitivityModel.from_data()))
    kw.setdefault("poll_s", 0.3)
    kw.setdefault("gpu_slots", cluster.gpu_slots)
    sh = SlurmShell(core, cluster.partition, tmp_path / "journal", SlurmCLI(str(cluster.conf)), **kw)
    sh.recover()
    return sh


def drive(shell: SlurmShell, pred, timeout: float = 60.0, what: str = "condition", interval: float = 0.3):
    """Step the shell until ``pred()`` is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        shell.step()
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last: {v!r})")
        time.sleep(interval)
