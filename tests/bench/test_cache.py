"""bench cache's parts that need no cgroup or donors: the synthetic JPEG dataset, its pipeline, and the
summary (ratios, the model's prediction, the targets) from recorded rounds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench import cache  # noqa: E402
from bench.cache_work import JpegFolder, augment  # noqa: E402
from scheduler.remote_memory import RemoteLink  # noqa: E402


def test_the_dataset_is_imagenet_like_jpegs_and_the_pipeline_decodes_them(tmp_path):
    info = cache.write_dataset(tmp_path, 3)
    assert info["images"] == 3 and 40e3 < info["jpeg_bytes_mean"] < 200e3
    ds = JpegFolder(str(tmp_path))
    x, y = ds[1]
    assert x.shape == (3, 224, 224) and x.dtype == torch.uint8 and y == 1
    assert torch.equal(ds[1][0], x)  # deterministic: the part the cache keeps
    assert augment((x, y))[0].dtype == torch.float32


def run_of(speeds: list[float], hit_local: float = 0.0, hit_remote: float = 0.0) -> dict:
    return {"epochs": [{"samples_per_s": s, "hit_local": hit_local, "hit_remote": hit_remote} for s in speeds],
            "load_start": [0.1], "load_end": [0.2]}


def test_the_summary_gives_the_ratios_the_prediction_and_the_targets():
    rounds = [{"none": run_of([100, 100, 100]), "local": run_of([100, 120, 120], 0.25),
               "lent": run_of([90, 380, 380], 0.25, 0.75), "all_local": run_of([100, 400, 400], 1.0),
               "attach": run_of([350, 360, 360], 0.0, 1.0)}] * 2
    link = RemoteLink(read_bytes_per_s=1e9, read_latency_s=1e-4)
    calib = {"link_obj": link, "doc": link.calibration("t", "test"), "path": "x"}
    res = cache._summarise(rounds, {"images": 10}, 150_000, True, [], None, None, kill={"kill": {"wrong_samples": 0}},
                           calib=calib, memshort=None)
    m = res["metrics"]
    assert m["cache_lent_vs_all_local"] == pytest.approx(0.95)
    assert m["cache_lent_vs_local_only"] == pytest.approx(380 / 120)
    assert m["cache_shared_first_epoch_vs_all_local"] == pytest.approx(350 / 400)
    assert m["cache_model_efficiency"] == 1.0  # 2 readers carry far more than 400 x 150 kB x 0.75 a second
    assert m["cache_model_predicted_samples_per_s"] == pytest.approx(400.0)
    assert m["cache_model_error"] == pytest.approx(20 / 380)
    assert m["remote_hit_extra_s"] == pytest.approx(1 / 360 - 1 / 400)
    met = {t["target"].split()[0]: t["met"] for t in res["targets"]}
    assert met["cache_lent_vs_all_local"] == "yes" and met["cache_donor_kill_wrong_samples"] == "yes"
    assert met["memshort_recovered"] == "n/a"
