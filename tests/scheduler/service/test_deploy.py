"""The deploy examples say what the code does: the extender stanza points at the routes the
service serves, with the verbs it implements; the DaemonSet runs flags `dlshare node` has."""

from __future__ import annotations

from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from nodesvc.cli import build_parser
from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from tests.scheduler.service.svc_helpers import TOKEN

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def test_kube_scheduler_configuration_extender_matches_the_service(store):
    cfg = yaml.safe_load((DEPLOY / "scheduler-config.yaml").read_text())
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1" and cfg["kind"] == "KubeSchedulerConfiguration"
    (ext,) = cfg["extenders"]
    assert ext["urlPrefix"].endswith("/k8s")
    app = create_app(SchedulerService(store), TOKEN, k8s_open=True)
    paths = set(app.openapi()["paths"])
    for verb in ("filterVerb", "prioritizeVerb", "bindVerb"):
        if verb in ext:
            assert f"/k8s/{ext[verb]}" in paths
    assert {"/k8s/filter", "/k8s/prioritize", "/k8s/bind"} <= paths
    assert 1 <= ext["weight"] and ext["ignorable"] is True
    with TestClient(app) as c:  # k8s_open: kube-scheduler's unauthenticated call works, /v1 still needs the token
        assert c.post("/k8s/filter", json={"Pod": {"metadata": {"name": "p"}}, "NodeNames": []}).status_code == 200
        assert c.get("/v1/jobs").status_code == 401


def test_daemonset_runs_dlshare_node_with_real_flags():
    docs = list(yaml.safe_load_all((DEPLOY / "dlshare-node-daemonset.yaml").read_text()))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["dlshare", "node"]
    build_parser().parse_args(c["command"][1:])  # the flags exist
    env = {e["name"]: e for e in c["env"]}
    assert env["DLSHARE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    toml = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["dlshare.toml"]
    import tomllib

    from nodesvc.bus import config
    import nodesvc.cli.node  # noqa: F401 - registers [node]
    parsed = tomllib.loads(toml)
    for sec, keys in parsed.items():
        for k in keys:
            assert k in config.defaults()[sec], f"{sec}.{k} is not a config key"


def test_sched_statefulset_flags_parse():
    docs = list(yaml.safe_load_all((DEPLOY / "dlshare-sched.yaml").read_text()))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    build_parser().parse_args(c["command"][1:])
