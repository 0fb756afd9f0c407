"""The Kubernetes extender: payloads shaped as kube-scheduler (k8s.io/kube-scheduler/extender/v1)
marshals them, Go field names and all; the core's plugins decide; bad input answered in the wire format."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler import Job
from scheduler.service import k8s
from scheduler.service.api import create_app
from tests.scheduler.service.svc_helpers import TOKEN, auth, node_list, pod, service_with_nodes
from nodesvc.bus.messages import telemetry_from


@pytest.fixture
def ext(store):
    svc = service_with_nodes(store, {"gpu-a": (4, 8), "gpu-b": (4, 8), "cpu-c": (0, 2)})
    with TestClient(create_app(svc, TOKEN)) as c:
        yield c, svc


def test_filter_with_node_list_keeps_gpu_nodes_and_explains_the_rest(ext):
    c, _ = ext
    args = {"Pod": pod(), "Nodes": node_list("gpu-a", "gpu-b", "cpu-c", "ghost"), "NodeNames": None}
    r = c.post("/k8s/filter", json=args, headers=auth())
    assert r.status_code == 200
    res = r.json()
    assert set(res) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert res["Error"] == ""
    assert [i["metadata"]["name"] for i in res["Nodes"]["items"]] == ["gpu-a", "gpu-b"]
    assert res["Nodes"]["items"][0]["status"]["capacity"]["cpu"] == "8"  # items echoed whole
    assert set(res["FailedNodes"]) == {"cpu-c", "ghost"}
    assert "GPU" in res["FailedNodes"]["cpu-c"] and "no dlshare node daemon" in res["FailedNodes"]["ghost"]


def test_filter_with_node_names_when_node_cache_capable(ext):
    c, _ = ext
    args = {"Pod": pod(gpus=0, cpu="1", memory="1Gi", model=None), "Nodes": None, "NodeNames": ["cpu-c", "gpu-a"]}
    res = c.post("/k8s/filter", json=args, headers=auth()).json()
    assert res["Nodes"] is None and res["NodeNames"] == ["cpu-c", "gpu-a"] and res["FailedNodes"] == {}
    big = {"Pod": pod(gpus=0, cpu="3", memory="1Gi", model=None), "NodeNames": ["cpu-c", "gpu-a"]}
    res = c.post("/k8s/filter", json=big, headers=auth()).json()
    assert res["NodeNames"] == ["gpu-a"] and "needs 3.1 cores" in res["FailedNodes"]["cpu-c"]


async def test_prioritize_scores_are_integers_0_to_10_from_the_core(ext):
    c, svc = ext
    # One GPU of gpu-a is busy: the dlshare profile consolidates, so gpu-a should score at least as high.
    svc.submit({"model": "resnet50", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})
    svc.round()
    busy = next(iter(svc.core.running.values())).shards[0].node
    r = c.post("/k8s/prioritize", json={"Pod": pod(), "Nodes": node_list("gpu-a", "gpu-b", "cpu-c")}, headers=auth())
    assert r.status_code == 200
    scores = {h["Host"]: h["Score"] for h in r.json()}
    assert set(scores) == {"gpu-a", "gpu-b", "cpu-c"}
    assert all(isinstance(s, int) and 0 <= s <= k8s.MAX_EXTENDER_PRIORITY for s in scores.values())
    assert scores["cpu-c"] == 0
    probe = Job(id="probe", model="resnet50", batch_size=64, gpus=1, cpus=2.1, memory_bytes=(4 << 30) + (64 << 20))
    expected: dict[str, float] = {}
    for cand, total in svc.core.candidates(probe):
        expected[cand.node.node.id] = max(expected.get(cand.node.node.id, 0.0), total)
    best = max(expected, key=expected.get)
    assert scores[best] == 10 and busy in expected
    for n, total in expected.items():
        assert scores[n] == round(10 * total / expected[best])


def test_bind_records_the_pod_on_the_node(ext):
    c, svc = ext
    c.post("/k8s/filter", json={"Pod": pod(name="p1", gpus=0, cpu="500m", memory="256Mi", model=None),
                                "NodeNames": ["cpu-c"]}, headers=auth())
    r = c.post("/k8s/bind", json={"PodName": "p1", "PodNamespace": "ml", "PodUID": "u-1", "Node": "cpu-c"},
               headers=auth())
    assert r.json() == {"Error": "", "Note": k8s.NOT_BOUND_NOTE}  # no binder: recorded only (test_k8s_bind.py)
    svc.round()  # the bind is a core event: the core holds the pod's resources on the node
    rec = svc.core.records["k8s.ml.p1.u-1"]
    assert rec.external and rec.shards[0].node == "cpu-c" and rec.job.state.value == "running"
    assert rec.job.cpus == pytest.approx(0.6) and rec.job.memory_bytes == (256 + 64) << 20  # main + sidecar
    assert svc.core.nodes["cpu-c"].reserved_cpus == pytest.approx(0.6)
    assert "k8s.ml.p1.u-1" in c.get("/v1/cluster", headers=auth()).json()["nodes"][0]["jobs"]
    assert c.post("/k8s/bind", json={"PodName": "p1", "PodNamespace": "ml", "Node": "nowhere"},
                  headers=auth()).json()["Error"].startswith("node nowhere")
    r = c.post("/k8s/bind", json={"PodNamespace": "ml", "Node": "cpu-c"}, headers=auth())
    assert r.status_code == 422 and "PodName" in r.json()["message"]
    assert "PodName" in c.post("/k8s/bind", json={"PodName": "", "PodNamespace": "ml", "Node": "cpu-c"},
                               headers=auth()).json()["Error"]


def test_malformed_extender_args_get_error_in_the_wire_format(ext):
    c, _ = ext
    res = c.post("/k8s/filter", json={"Pod": {"metadata": {}}, "NodeNames": ["gpu-a"]}, headers=auth()).json()
    assert "name is missing" in res["Error"] and res["NodeNames"] is None
    bad_qty = pod(cpu="two")
    res = c.post("/k8s/filter", json={"Pod": bad_qty, "NodeNames": ["gpu-a"]}, headers=auth()).json()
    assert "cannot parse resource quantity 'two'" in res["Error"]
    r = c.post("/k8s/prioritize", json={"Pod": pod(), "NodeNames": "gpu-a"}, headers=auth())
    assert r.status_code == 422 and "NodeNames" in r.json()["message"]  # the Go type is []string
    r = c.post("/k8s/prioritize", json={"Pod": {"metadata": {"name": "p"}, "spec": {"containers": 5}}, "NodeNames": ["gpu-a"]}, headers=auth())
    assert r.status_code == 400 and "containers must be a list" in r.json()["Error"]
    assert c.post("/k8s/filter", json={"Pod": pod(), "NodeNames": []}).status_code == 401


@pytest.mark.parametrize("q, v", [("500m", 0.5), ("2", 2.0), ("1Gi", 2.0**30), ("1G", 1e9), ("1.5Ki", 1536.0),
                                  ("1e3", 1000.0), ("100M", 1e8), ("0", 0.0), (3, 3.0)])
def test_quantities(q, v):
    assert k8s.parse_quantity(q) == pytest.approx(v)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                           max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["Pod", "Nodes", "NodeNames", "metadata", "spec"]), json_values, max_size=4))
def test_fuzz_extender_parsers_raise_only_extender_error(args):
    try:
        k8s.pod_to_job(args.get("Pod"))
    except k8s.ExtenderError:
        pass
    try:
        k8s.candidate_names(args)
    except k8s.ExtenderError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12) | st.integers() | st.floats(allow_nan=False) | st.none())
def test_fuzz_quantity(q):
    try:
        v = k8s.parse_quantity(q)
    except k8s.ExtenderError:
        return
    assert v >= 0


def test_gpu_generation_comes_from_nvml_names_or_node_labels(store):
    """Issue 23: the core's nodes carry their GPU generation: NVML's device name in telemetry, else
    the Kubernetes label (GPU Feature Discovery's ``nvidia.com/gpu.product``) kube-scheduler sends."""
    from tests.scheduler.service.svc_helpers import telemetry

    svc = service_with_nodes(store, {"gpu-a": (4, 8), "gpu-b": (4, 8)})
    named = telemetry("gpu-v", 2, 8)
    for d in named["gpus"]["devices"]:
        d["name"] = "Tesla V100-SXM2-32GB"
    svc.translator.on_telemetry(telemetry_from(named))
    svc.round()
    assert svc.core.nodes["gpu-v"].node.gpu_type == "v100"
    assert svc.core.nodes["gpu-a"].node.gpu_type == ""  # "sim" names no generation
    nodes = node_list("gpu-a", "gpu-b")
    nodes["items"][0]["metadata"]["labels"]["nvidia.com/gpu.product"] = "Tesla-K80"
    nodes["items"][1]["metadata"]["labels"]["dlshare.io/gpu-type"] = "a100"
    assert k8s.gpu_type_labels({"Nodes": nodes}) == {"gpu-a": "k80", "gpu-b": "a100"}
    assert k8s.gpu_type_labels({"NodeNames": ["gpu-a"]}) == {}
    with TestClient(create_app(svc, TOKEN)) as c:
        r = c.post("/k8s/filter", json={"Pod": pod(), "Nodes": nodes, "NodeNames": None}, headers=auth())
        assert r.status_code == 200 and r.json()["Error"] == ""
    for n in ("gpu-a", "gpu-b"):  # the next telemetry carries the label to the core
        svc.translator.on_telemetry(telemetry_from(telemetry(n, 4, 8)))
    svc.round()
    assert svc.core.nodes["gpu-a"].node.gpu_type == "k80" and svc.core.nodes["gpu-b"].node.gpu_type == "a100"
