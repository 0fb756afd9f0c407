"""Shared-data access and the fetch conversions, on local inputs (no network)."""

import json

import pytest

from scheduler import data, fetch


def test_fetch_conversions_on_local_inputs(tmp_path):
    thr = {str(("ResNet-18 (batch size 32)", 1)): {"null": 10.0}, str(("A3C", 2)): {"null": 4.0}}
    gavel = ("ResNet-18 (batch size 32)\tcmd\tdir\t--n\tFalse\t1000\t1\t1\t-1\t50.0\n"
             "A3C\tcmd\tdir\t--n\tFalse\t400\t2\t1\t-1\t20.0\n"
             "Unknown\tcmd\tdir\t--n\tFalse\t5\t1\t1\t-1\t30.0\n")
    csv_text = fetch.convert_gavel_trace(gavel, thr)
    lines = csv_text.splitlines()
    assert lines[1] == "0,0.0,A3C,0,2,400,100.0" and lines[2] == "1,30.0,ResNet-18,32,1,1000,100.0"
    assert len(lines) == 3
    assert fetch.convert_synergy_trace("0 alexnet 0.0 10 1\n1,gnmt,0.5,20,1\n").splitlines()[2] == "1,gnmt,0.5,20,1"
    assert fetch.convert_colocation("h\n" + "".join(f"{i}\n" for i in range(10))).splitlines() == ["h", *map(str, range(7))]
    src = ("import numpy as np\nclass alexnet_1:\n    def update_stats(self):\n        self.cpus = 12\n"
           "        self.mem = 62.5*2\n        self.batch = 512\n        self.iter_time = 0.6\n"
           "        self.tput = np.array([\n [0.1, 0.3],\n [0.1, -1]])\n        self.other = open('x')\n")
    model = fetch.convert_synergy_model(src)
    assert model == {"cpus": 12, "mem": 125.0, "batch": 512, "iter_time": 0.6, "tput": [[0.1, 0.3], [0.1, -1]]}
    with pytest.raises(ValueError, match="no tput"):
        fetch.convert_synergy_model("x = __import__('os')\n")
    sens = fetch.assemble_sensitivity({"alexnet_1": src, "model_stats": "x = 1\n"})
    assert list(sens["models"]) == ["alexnet_1"]
    assert sens["models"]["alexnet_1"]["best_mem_gb"] == 125.0 and sens["models"]["alexnet_1"]["num_gpus"] == 1
    served = {}

    def fake_get(url):
        served[url] = True
        if "api.github.com" in url:
            return json.dumps([{"name": "alexnet_1.py"}, {"name": "__init__.py"}, {"name": "model_stats.py"}])
        if url.endswith("alexnet_1.py"):
            return src
        if url.endswith("simulation_throughputs.json"):
            return json.dumps({"v100": thr})
        if url.endswith(".trace"):
            return gavel
        if "static_100job" in url:
            return "0 alexnet 0.0 10 1\n"
        return "a,b\n1,2\n"

    written = fetch.fetch(tmp_path / "cache", log=lambda s: None, get=fake_get)
    assert "philly/vc_0e4a51.csv" in written and (tmp_path / "cache/gavel/throughputs.json").exists()
    assert "synergy/sensitivity.json" in written
    assert json.loads((tmp_path / "cache/synergy/sensitivity.json").read_text())["models"]["alexnet_1"]["iter_time_s"] == 0.6
    assert all(u.startswith(("https://raw.githubusercontent.com/", "https://api.github.com/")) for u in served)


def test_data_dir_prefers_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DLSHARE_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    with pytest.raises(data.DataError, match="dlshare data fetch"):
        data.path("philly/vc_0e4a51.csv")
