"""dlshare data fetch: the Lucid files, converted from local inputs (no network here)."""

from scheduler import data, fetch


def test_lucid_index_column_is_dropped_and_the_result_loads(tmp_path):
    src = ",model1,dataset1,gpu_num1,batchsize1,amp1,speed1,model2,dataset2,gpu_num2,batchsize2,amp2,speed2\n" \
          "0,ResNet18,CIFAR-10,1,32,0,0.9,VGG,CIFAR-10,1,64,1,0.8\n"
    out = fetch.convert_lucid_colocation(src)
    assert out.splitlines()[0].startswith("model1,")
    p = tmp_path / "c.csv"
    p.write_text(out)
    rows = data.lucid_colocation(p)
    assert rows == [{"model1": "ResNet18", "dataset1": "CIFAR-10", "batchsize1": 32, "amp1": 0, "speed1": 0.9,
                     "model2": "VGG", "dataset2": "CIFAR-10", "batchsize2": 64, "amp2": 1, "speed2": 0.8}]
    # already converted: unchanged
    assert fetch.convert_lucid_colocation(out) == out


def test_fetch_writes_the_lucid_files(tmp_path):
    import json

    thr = {str(("ResNet-18 (batch size 32)", 1)): {"null": 10.0}}
    served = []

    def get(url):
        served.append(url)
        if "api.github.com" in url:
            return json.dumps([])
        if url.endswith("simulation_throughputs.json"):
            return json.dumps({"v100": thr})
        if url.endswith(".trace"):
            return "ResNet-18 (batch size 32)\tcmd\tdir\t--n\tFalse\t1000\t1\t1\t-1\t50.0\n"
        if url.endswith("colocate_info.csv"):
            return ",model1,dataset1,batchsize1,amp1,speed1,model2,dataset2,batchsize2,amp2,speed2\n" \
                   "0,A,D,32,0,0.9,B,E,64,1,0.8\n"
        if url.endswith("single_data.csv"):
            return "model,dataset,batchsize,amp,speed,gpu_util,gmem_util,gmem,label\nA,D,32,0,100,50,20,2000,1\n"
        if "static_100job" in url:
            return "0 alexnet 0.0 10 1\n"
        return "a,b\n1,2\n"

    written = fetch.fetch(tmp_path, log=lambda m: None, get=get)
    assert {"lucid/colocation.csv", "lucid/solo.csv"} <= set(written)
    assert [u for u in served if "S-Lab-System-Group/Lucid" in u and fetch.LUCID[1] in u]
    assert data.lucid_colocation(tmp_path / "lucid/colocation.csv")[0]["speed2"] == 0.8
    assert data.lucid_solo(tmp_path / "lucid/solo.csv")[0]["gpu_util"] == 50.0
    assert "lucid/colocation.csv" in data.FILES and "lucid/solo.csv" in data.FILES
