"""The simulator's decisions use only what a live system would know; the oracle knows every pair;
``dlshare sim predictor`` on Lucid rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import Job, data
from scheduler.events import NodeReport, Place
from scheduler.predictors.lucid_proxy import FAMILIES, GavelSoloProfiles
from scheduler.sim import Cluster, GroundTruth, oracle_predictors, simulate
from scheduler.trace import TraceJob

ROOT = Path(__file__).resolve().parents[3]


def test_gavel_models_get_the_solo_profile_of_their_lucid_family():
    prof = GavelSoloProfiles.from_data()
    r18 = prof.profile("ResNet-18", 32)
    assert (r18.sm_percent, r18.mem_percent) == (58.667, 25.0)  # lucid/solo.csv: ResNet18, CIFAR-10, 32, no AMP
    assert prof.profile("ResNet-18", 256) == prof.profile("ResNet-18", 128)  # nearest measured batch size
    assert prof.profile("LM", 20).sm_percent > 50  # the LSTM's profile
    assert prof.profile("NoSuchModel", 32) is None
    assert set(FAMILIES) >= {"ResNet-18", "ResNet-50", "Transformer", "LM", "Recommendation"}


def test_solo_telemetry_reaches_the_core_only_after_the_job_ran_alone():
    seen = []
    tr = [TraceJob("a", 0.0, "ResNet-18", 32, 1, 0, 3600.0)]

    class Spy:
        def __init__(self):
            from scheduler.predictors import Predictors

            self.p = Predictors()

        def __getattr__(self, k):
            return getattr(self.p, k)

        def observe(self, job_type, others, sample):
            seen.append((job_type, others, sample))
            self.p.observe(job_type, others, sample)

    simulate(tr, Cluster.parse("1x1"), "fifo", predictors=Spy(), report_delay_s=60.0)
    assert seen and seen[0][0] == "ResNet-18@32" and seen[0][1] == ()
    assert seen[0][2].sm_percent == pytest.approx(58.667)


def test_placement_decisions_do_not_know_unseen_pairs_but_the_oracle_does():
    truth = GroundTruth(data.gavel_throughputs()["v100"], None, GavelSoloProfiles.from_data())
    oracle = oracle_predictors(truth)
    a, b = Job("a", "ResNet-50", 64), Job("b", "Transformer", 128)
    assert oracle.colocated_speeds(a.job_type, [b.job_type], a, [b]) == pytest.approx(list(truth.pair(a, b)))
    # the default bundle has never seen this pair and has no solo telemetry yet: it cannot know the truth
    from scheduler.predictors import Predictors

    live = Predictors()
    assert live.colocated_speeds(a.job_type, [b.job_type], a, [b]) == [live.pairs.prior_speed] * 2


def test_dlshare_runs_on_live_knowledge_and_on_the_oracle():
    # 1-GPU jobs on a small, full cluster, so dlshare considers sharing
    tr = [TraceJob(str(i), 60.0 * i, m, bs, 1, 0, 4 * 3600.0)
          for i, (m, bs) in enumerate([("ResNet-50", 64), ("Transformer", 128), ("ResNet-18", 32), ("LM", 20)] * 4)]
    places: dict[str, list] = {"live": [], "oracle": []}
    for k in places:
        r = simulate(tr, Cluster.parse("1x2"), "dlshare", predictors=None if k == "live" else "oracle",
                     on_decision=lambda d, k=k: places[k].append(d) if isinstance(d, Place) else None)
        assert r.failed == 0 and r.metrics()["jobs"] == len(tr)
    shared = {k: sum(1 for d in v if d.colocated_with) for k, v in places.items()}
    assert shared["oracle"] > 0  # some of Gavel's pairs are worth sharing


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "nodesvc.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_cli_predictor_on_lucid_rows_reports_mape_and_mae(tmp_path):
    src = data.path("lucid/colocation.csv").read_text().splitlines()
    head, rows = src[0], src[1:]
    train = [r for r in rows if "VGG" not in r]
    test = [r for r in rows if "VGG" in r]
    (tmp_path / "train.csv").write_text("\n".join([head, *train]) + "\n")
    (tmp_path / "test.csv").write_text("\n".join([head, *test]) + "\n")
    out = tmp_path / "p.json"
    p = run_cli("sim", "predictor", "--train", str(tmp_path / "train.csv"), "--test", str(tmp_path / "test.csv"),
                "--json", str(out))
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["format"] == "lucid" and res["test_rows"] == len(test) and res["train_rows"] == len(train)
    assert res["test_pairs_seen_in_training"] == 0 and 0 < res["mape"] < 1 and res["mae"] > 0
    # IADeep rows against Lucid rows: a clear error, not a crash
    p = run_cli("sim", "predictor", "--train", str(tmp_path / "train.csv"), "--test",
                str(data.path("iadeep/colocation_util.csv")))
    assert p.returncode == 2 and "different formats" in p.stderr
