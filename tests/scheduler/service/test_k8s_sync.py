"""``k8s.sync_plan``: what the core must learn from the API server's pods (PodSync's pure part;
the real API server drives it in tests/k8s)."""

from __future__ import annotations

from scheduler.service import k8s


def pod(name: str, node: str | None = None, phase: str = "Pending", uid: str = "0123456789ab", gpus: int = 1) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"schedulerName": "dlshare", **({"nodeName": node} if node else {}),
                     "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def jid(name: str, uid: str = "0123456789ab") -> str:
    return k8s.pod_job_id("default", name, uid)


def test_bound_pods_the_core_does_not_hold_are_bound_and_ended_ones_finished():
    pods = [pod("a", "n1", "Running"), pod("b", "n2", "Pending"), pod("c"), pod("d", "n1", "Succeeded"),
            pod("e", "n2", "Failed")]
    held = {jid("a"): "n1", jid("d"): "n1", jid("e"): "n2", jid("gone"): "n1"}
    to_bind, to_finish = k8s.sync_plan(pods, held, set(held))
    assert [(r.name, n) for r, n in to_bind] == [("b", "n2")]  # c is not bound, a is held already
    assert to_bind[0][0].job["spec"]["gpus"] == 1 and to_bind[0][0].uid == "0123456789ab"
    assert sorted(to_finish) == [(jid("d"), False), (jid("e"), True), (jid("gone"), False)]


def test_a_pod_recreated_under_its_name_is_another_job_and_a_finished_one_is_not_bound_again():
    held = {jid("a", "old-uid-000"): "n1"}
    to_bind, to_finish = k8s.sync_plan([pod("a", "n2", "Running", uid="new-uid-111")], held, set(held))
    assert [(r.uid, n) for r, n in to_bind] == [("new-uid-111", "n2")]
    assert to_finish == [(jid("a", "old-uid-000"), False)]
    # a job the core has a record of (it ended there) is not bound again from a stale list
    to_bind, _ = k8s.sync_plan([pod("x", "n1", "Running")], {}, {jid("x")})
    assert to_bind == []


def test_unreadable_pods_are_skipped_not_fatal():
    bad = pod("q", "n1", "Running")
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "lots"
    to_bind, to_finish = k8s.sync_plan([bad, {"metadata": {}}, pod("ok", "n1", "Running")], {}, set())
    assert [r.name for r, _ in to_bind] == ["ok"] and to_finish == []


def test_order_refuses_a_pod_while_one_ahead_in_dlshares_order_fits(store):
    """``k8s_order``: the core's order among the waiting pods decides; a pod ahead that fits nowhere
    does not hold the others back."""
    from tests.scheduler.service.svc_helpers import pod as kpod, service_with_nodes

    svc = service_with_nodes(store, {"n1": (4, 16)}, profile="fifo")  # FIFO: the earlier pod goes first
    early, late, huge = kpod("early"), kpod("late"), kpod("huge", gpus=8)
    early["metadata"].update(uid="uid-early-0", creationTimestamp="2026-11-21T08:00:00Z")
    late["metadata"].update(uid="uid-late-00", creationTimestamp="2026-11-21T08:00:05Z")
    huge["metadata"].update(uid="uid-huge-00", creationTimestamp="2026-11-21T07:00:00Z")
    k8s.apply_sync(svc, [early, late, huge])
    assert set(svc.k8s_waiting) == {k8s.pod_job_id("ml", n, u) for n, u in
                                    (("early", "uid-early-0"), ("late", "uid-late-00"), ("huge", "uid-huge-00"))}
    why = k8s.order_refusal(svc, k8s.pod_to_job(late))
    assert why == "dlshare order: pod ml/early goes first (it fits now)"
    # the earliest pod (huge) needs 8 GPUs and fits nowhere: it does not block early
    assert k8s.order_refusal(svc, k8s.pod_to_job(early)) == ""
    # once early is bound (it left the waiting list), late may go
    early_bound = {**early, "spec": {**early["spec"], "nodeName": "n1"}, "status": {"phase": "Running"}}
    k8s.apply_sync(svc, [early_bound, late, huge])
    assert k8s.order_refusal(svc, k8s.pod_to_job(late)) == ""
    # a pod not listed yet gets no opinion
    assert k8s.order_refusal(svc, k8s.pod_to_job(kpod("unlisted"))) == ""


def test_a_list_older_than_a_binding_does_not_finish_it(store):
    from tests.scheduler.service.svc_helpers import pod as kpod, service_with_nodes

    svc = service_with_nodes(store, {"n1": (4, 16)})
    p = kpod("bound")
    p["spec"]["nodeName"] = "n1"
    p["status"]["phase"] = "Running"
    assert k8s.apply_sync(svc, [p]) == (1, 0)  # taken in: a JobBound
    svc.round()
    jid = k8s.pod_job_id("ml", "bound", p["metadata"]["uid"])
    rec = svc.core.records[jid]
    assert rec.external and rec.job.state.active and rec.run_since is not None
    # a list asked for before the binding (the bind route's race) omits the pod: not finished on its word
    assert k8s.apply_sync(svc, [], listed_at=rec.run_since - 5.0) == (0, 0)
    # a list asked for after it: the pod is gone, so it is finished
    assert k8s.apply_sync(svc, [], listed_at=rec.run_since + 5.0) == (0, 1)
    svc.round()
    assert not svc.core.records[jid].job.state.active
