"""The extender under a real kube-apiserver and kube-scheduler (1.20, tests/k8s/conftest.py):
kube-scheduler calls dlshare's filter, prioritize and bind over the wire; dlshare posts the
Binding to the real API server; faults are real (``kill -9`` of dlshare, an API server restart)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import yaml

from nodesvc.bus.procs import wait_until
from scheduler.service import k8s_testbed as tb
from tests.k8s.conftest import NODES

_n = itertools.count()
NS = "default"


@pytest.fixture(autouse=True)
def no_pods_left(k8s):
    """Each test starts on empty nodes: its pods are deleted after it (and dlshare lets them go)."""
    yield
    for p in k8s.api.pods(NS):
        k8s.api.delete_pod(NS, p["metadata"]["name"])
    wait_until(lambda: not k8s.api.pods(NS), timeout=30, what="the test's pods deleted", interval=0.2)
    if "sched" in k8s.dlshare.procs:
        wait_until(lambda: not dlshare_holds(k8s), timeout=30, what="dlshare let the deleted pods go", interval=0.3)


def pod_name(prefix: str) -> str:
    return f"{prefix}-{next(_n)}"


def node_of(k8s, name: str) -> str | None:
    return k8s.api.pod(NS, name)["spec"].get("nodeName")


def wait_bound(k8s, name: str, timeout: float = 60.0) -> str:
    return wait_until(lambda: node_of(k8s, name), timeout=timeout, what=f"pod {name} bound", interval=0.2,
                      ignore=(tb.TestbedError,))


def dlshare_holds(k8s) -> list[tuple[str, str]]:
    """dlshare's books: (pod name, node) for each pod its core holds (job ids are k8s.NS.NAME.UID8)."""
    return [(j[len(f"k8s.{NS}."):].rsplit(".", 1)[0], n["id"]) for n in k8s.dlshare.client().cluster()["nodes"]
            for j in n["jobs"] if j.startswith(f"k8s.{NS}.")]


def dlshare_view(k8s) -> dict[str, str]:
    """pod name -> the node dlshare's core holds it on."""
    return dict(dlshare_holds(k8s))


def api_view(k8s) -> dict[str, str]:
    """pod name -> node, for the dlshare pods the API server has bound and not ended, on the nodes
    dlshare knows (kube-scheduler alone may use kn3, which has no dlshare node daemon)."""
    return {p["metadata"]["name"]: p["spec"]["nodeName"] for p in k8s.api.pods(NS)
            if p["spec"].get("schedulerName") == "dlshare" and p["spec"].get("nodeName") in NODES
            and p["status"].get("phase") not in ("Succeeded", "Failed")}


def wait_books_agree(k8s, timeout: float = 30.0) -> None:
    try:
        wait_until(lambda: dlshare_view(k8s) == api_view(k8s), timeout=timeout, interval=0.3,
                   what="dlshare's books == the API server's")
    except TimeoutError:
        raise AssertionError(f"dlshare holds {dlshare_holds(k8s)}, the API server has {api_view(k8s)}") from None


def scheduling_message(k8s, name: str) -> str:
    pod = k8s.api.pod(NS, name)
    conds = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"]
    msgs = [c.get("message", "") for c in conds if c.get("status") == "False"]
    msgs += [e.get("message", "") for e in k8s.api.events(NS, name) if e.get("reason") == "FailedScheduling"]
    return "\n".join(msgs)


def test_shipped_config_becomes_v1beta1_by_its_api_version_alone(k8s):
    shipped = yaml.safe_load((tb.DEPLOY / "scheduler-config.yaml").read_text())
    cfg = tb.v1beta1_config(shipped, "http://127.0.0.1:1/k8s", k8s.kube.kubeconfig)
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1beta1"
    ext, orig = cfg["extenders"][0], shipped["extenders"][0]
    assert {k: v for k, v in ext.items() if k != "urlPrefix"} == {k: v for k, v in orig.items() if k != "urlPrefix"}
    # ...and the running kube-scheduler accepted it (it would exit on an unknown or mistyped field)
    assert k8s.kube.procs["kube-scheduler"].poll() is None, k8s.kube.log_tail("kube-scheduler")
    # Its health server takes a free loopback port, not its default 0.0.0.0:10251, which a real one would hold.
    def serving() -> list[str]:
        return [line.rsplit(" ", 1)[-1] for line in k8s.kube.log_tail("kube-scheduler", 100_000).splitlines()
                if "Serving healthz insecurely on" in line]

    addrs = wait_until(serving, timeout=60, what="kube-scheduler serving its health checks")
    assert all(a.startswith("127.0.0.1:") and not a.endswith(":10251") for a in addrs), addrs


def test_gpu_pod_filtered_scored_and_bound_by_dlshare(k8s):
    log_start = (k8s.kube.root / "kube-scheduler.log").stat().st_size  # the session's scheduler: this test's lines
    names = [pod_name("gpu") for _ in range(3)]
    for n in names:
        k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
    nodes = {n: wait_bound(k8s, n) for n in names}
    # kn3 has the most GPUs but no dlshare node daemon: only dlshare's filter keeps pods off it...
    assert set(nodes.values()) <= {"kn1", "kn2"}, nodes
    # ...and kube-scheduler reached it (over HTTPS, its certificate checked): an extender that fails is
    # skipped (ignorable), and the pods then land on kn1 and kn2 by chance in a third of the runs
    with open(k8s.kube.root / "kube-scheduler.log", "rb") as f:
        f.seek(log_start)
        skipped = [line for line in f.read().decode(errors="replace").splitlines() if "Skipping extender" in line]
    assert not skipped, skipped[-3:]
    # dlshare's books hold each pod on the node the API server has
    view = wait_until(lambda: (v := dlshare_view(k8s)) and all(n in v for n in names) and v, timeout=30,
                      what="dlshare holds the pods", interval=0.2)
    assert {n: view[n] for n in names} == nodes
    # kube-scheduler bound them (the shipped config has no bindVerb); dlshare's filter saw each pod
    log = (k8s.dlshare.root / "sched.log").read_text(errors="replace")
    for n in names:
        assert f"pod {NS}/{n} runs on node {nodes[n]} without dlshare having bound it" in log
    # the lifecycle driver ran them (no kubelet): Running on their node
    wait_until(lambda: all(k8s.api.pod(NS, n)["status"].get("phase") == "Running" for n in names), timeout=30,
               what="pods Running", interval=0.2)


def test_pod_that_cannot_fit_carries_dlshare_reason(k8s):
    name = pod_name("big")
    k8s.api.create_pod(name, gpus=8, cpu="100m", memory="64Mi")  # only kn3 has 8 GPUs, and dlshare refuses it
    msg = wait_until(lambda: (m := scheduling_message(k8s, name)) and "dlshare" in m and m, timeout=60,
                     what="FailedScheduling with dlshare's reason", interval=0.3)
    assert "no dlshare node daemon reports from this node" in msg, msg
    assert "Insufficient nvidia.com/gpu" in msg, msg  # kube-scheduler's own filters for kn1 and kn2
    assert node_of(k8s, name) is None
    k8s.api.delete_pod(NS, name)


GROUPS = {"v1": "/api/v1"}


def resource_path(obj: dict[str, Any]) -> str:
    kind, api_version = obj["kind"], obj["apiVersion"]
    base = GROUPS.get(api_version, f"/apis/{api_version}")
    plural = kind.lower()
    plural = plural[:-1] + "ies" if plural.endswith("y") else plural + ("es" if plural.endswith("s") else "s")
    ns = (obj.get("metadata") or {}).get("namespace")
    return f"{base}/namespaces/{ns}/{plural}" if ns else f"{base}/{plural}"


def test_manifests_accepted_by_the_real_api_server_in_a_server_side_dry_run(k8s):
    docs = [d for f in ("dlshare-node-daemonset.yaml", "dlshare-sched.yaml")
            for d in yaml.safe_load_all((tb.DEPLOY / f).read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "StatefulSet", "ClusterRole", "ClusterRoleBinding", "NetworkPolicy", "Namespace"} <= kinds
    # the namespace for real (a dry-run object in a namespace that does not exist is refused), then the rest
    for d in docs:
        if d["kind"] == "Namespace":
            k8s.api.request("POST", resource_path(d), ok=(201, 409), json=d)
    for d in docs:
        if d["kind"] == "Namespace":
            continue
        out = k8s.api.create(resource_path(d), d, dry_run=True)  # raises with the API server's message
        assert out["kind"] == d["kind"] and out["metadata"]["name"] == d["metadata"]["name"]
    # dry run: nothing was created
    assert k8s.api.request("GET", "/apis/apps/v1/namespaces/dlshare-system/statefulsets")["items"] == []
    # and a broken manifest is refused, so the check can fail
    bad = next(d for d in docs if d["kind"] == "DaemonSet")
    bad = {**bad, "spec": {**bad["spec"], "selector": {"matchLabels": {"app": "other"}}}}
    try:
        k8s.api.create(resource_path(bad), bad, dry_run=True)
    except tb.TestbedError as exc:
        assert "422" in str(exc) and "selector" in str(exc)
    else:
        raise AssertionError("the API server accepted a DaemonSet whose selector does not match its template")


def test_dlshare_killed_pods_schedule_without_it_and_when_back_its_books_agree(k8s):
    k8s.dlshare.kill9_sched()
    try:
        names = [pod_name("outage") for _ in range(2)]
        for n in names:
            k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
        # ignorable: true: kube-scheduler schedules without the extender
        nodes = {n: wait_bound(k8s, n, timeout=90) for n in names}
    finally:
        k8s.dlshare.start_sched()
    assert all(nodes.values())
    # back: dlshare takes in what was bound while it was down; its books equal the API server's,
    # each pod held once, on one node
    wait_books_agree(k8s)
    holds = dlshare_holds(k8s)
    assert len(holds) == len({p for p, _ in holds}), holds
    # and it schedules again, through the extender
    n = pod_name("after")
    k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
    node = wait_bound(k8s, n)
    wait_until(lambda: dlshare_view(k8s).get(n) == node, timeout=30, what="the new pod held by dlshare", interval=0.3)


def test_api_server_restart_loses_no_binding(k8s):
    names = [pod_name("restart") for _ in range(2)]
    for n in names:
        k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
    before = {n: wait_bound(k8s, n) for n in names}
    k8s.kube.restart_apiserver()
    after = {n: node_of(k8s, n) for n in names}
    assert after == before
    # kube-scheduler, dlshare's binder and its pod sync reconnect: a new pod is bound through the extender,
    # and dlshare's books still equal the API server's
    n = pod_name("post-restart")
    k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
    node = wait_bound(k8s, n, timeout=90)
    wait_books_agree(k8s)
    assert dlshare_view(k8s)[n] == node


def test_ended_pod_frees_its_gpus_in_dlshare(k8s):
    n = pod_name("short")
    k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi", duration_s=1.0)
    wait_bound(k8s, n)
    wait_until(lambda: k8s.api.pod(NS, n)["status"].get("phase") == "Succeeded", timeout=30, what="pod Succeeded",
               interval=0.2)
    wait_until(lambda: n not in dlshare_view(k8s), timeout=30, what="dlshare released the ended pod", interval=0.3)


def test_with_bind_verb_dlshare_binds_and_a_pod_waits_while_it_is_down(k8s):
    """The alternative the shipped config describes: ``bindVerb: bind``.  dlshare posts the Binding;
    kube-scheduler 1.20 does not apply ``ignorable`` to bind, so while dlshare is down the pod waits
    (the reason the shipped config leaves bindVerb out), and is bound once dlshare is back."""
    cfg = json.loads(json.dumps(k8s.config))
    cfg["extenders"][0]["bindVerb"] = "bind"
    k8s.kube.start_scheduler(cfg)
    try:
        n = pod_name("bindverb")
        k8s.api.create_pod(n, gpus=1, cpu="100m", memory="64Mi")
        node = wait_bound(k8s, n)
        wait_until(lambda: f"bound pod {NS}/{n} to node {node}" in
                   (k8s.dlshare.root / "sched.log").read_text(errors="replace"), timeout=30,
                   what="dlshare's binder posted the Binding", interval=0.2)
        # the core records the bind once the Binding exists (after that log line): wait for it, then
        # it must be held once, on that node
        wait_until(lambda: (n, node) in dlshare_holds(k8s), timeout=30, what="dlshare's core holds the bound pod",
                   interval=0.2)
        assert dlshare_holds(k8s).count((n, node)) == 1
        k8s.dlshare.kill9_sched()
        try:
            w = pod_name("waits")
            k8s.api.create_pod(w, gpus=1, cpu="100m", memory="64Mi")
            wait_until(lambda: "binding rejected" in k8s.kube.log_tail("kube-scheduler", 200) and w in
                       k8s.kube.log_tail("kube-scheduler", 200), timeout=60, what="kube-scheduler's bind refused",
                       interval=0.3)
            assert node_of(k8s, w) is None
        finally:
            k8s.dlshare.start_sched()
        # kube-scheduler parked the pod as unschedulable: it retries after 60 s (podMaxUnschedulableQDuration)
        # or at a cluster event; a node's label changing is one (here, not to wait the minute out)
        k8s.api.request("PATCH", "/api/v1/nodes/kn1", json={"metadata": {"labels": {"testbed.dlshare.io/nudge": w}}},
                        headers={"Content-Type": "application/merge-patch+json"})
        wb = wait_bound(k8s, w, timeout=90)
        wait_books_agree(k8s)
        assert dlshare_holds(k8s).count((w, wb)) == 1
    finally:
        k8s.restart_scheduler()


def test_k8s_order_imposes_dlshares_order_on_kube_schedulers_queue(k8s):
    """``[sched] k8s_order``: kube-scheduler pops the earlier pod first, dlshare refuses it while the pod
    ahead of it in dlshare's order (higher ``dlshare.io/priority``) fits, so that one is bound first."""
    dl = k8s.dlshare
    # Every GPU taken first, with the order off: with it on, a blocker that kube-scheduler pops before
    # one ahead of it is refused and waits in kube-scheduler's unschedulable queue for the next event
    # that moves it, or 60 s (README, "dlshare's order through kube-scheduler"): the equal blockers
    # would test that cost, not the order.
    blockers = [pod_name("block") for _ in range(sum(NODES.values()))]
    for b in blockers:
        k8s.api.create_pod(b, gpus=1, cpu="100m", memory="64Mi")
    for b in blockers:
        wait_bound(k8s, b)
    dl.env["DLSHARE_SCHED_K8S_ORDER"] = "true"
    dl.kill9_sched()
    dl.start_sched()
    try:
        wait_books_agree(k8s)  # the restarted service holds the blockers where the API server has them
        low, high = pod_name("low"), pod_name("high")
        k8s.api.create_pod(low, gpus=1, cpu="100m", memory="64Mi")
        k8s.api.create_pod(high, gpus=1, cpu="100m", memory="64Mi", annotations={"dlshare.io/priority": "10"})
        # both wait for a GPU, and dlshare's pod list has them both
        for n in (low, high):
            wait_until(lambda n=n: "Insufficient nvidia.com/gpu" in scheduling_message(k8s, n), timeout=60,
                       what=f"{n} waits for a GPU", interval=0.3)
        wait_until(lambda: dl.client()._call("GET", "/v1/stats")["k8s_waiting_pods"] == 2, timeout=30,
                   what="dlshare lists the two waiting pods", interval=0.3)
        k8s.api.delete_pod(NS, blockers[0])  # one GPU frees: kube-scheduler retries both, low first
        node = wait_bound(k8s, high)
        assert node in NODES and node_of(k8s, low) is None
        wait_until(lambda: "dlshare order: pod default/" + high + " goes first" in scheduling_message(k8s, low),
                   timeout=30, what="low refused with dlshare's order as the reason", interval=0.3)
        k8s.api.delete_pod(NS, blockers[1])
        wait_bound(k8s, low)  # nothing ahead of it now
    finally:
        dl.env.pop("DLSHARE_SCHED_K8S_ORDER", None)
        dl.kill9_sched()
        dl.start_sched()
