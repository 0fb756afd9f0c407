"""Kubernetes scheduler extender: ``POST /k8s/filter``, ``/k8s/prioritize``, ``/k8s/bind``.

The wire format is kube-scheduler's (``k8s.io/kube-scheduler/extender/v1``):
Go structs without JSON tags, so the keys are the Go field names.

- ``ExtenderArgs`` ``{"Pod": v1.Pod, "Nodes": v1.NodeList | null, "NodeNames": [str] | null}``
  (``NodeNames`` when the extender is configured ``nodeCacheCapable: true``).
- ``ExtenderFilterResult`` ``{"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}``.
- ``HostPriorityList`` ``[{"Host": str, "Score": int}]`` with scores in 0..10
  (``MaxExtenderPriority``; kube-scheduler multiplies by the extender's weight).
- ``ExtenderBindingArgs`` ``{"PodName", "PodNamespace", "PodUID", "Node"}`` ->
  ``ExtenderBindingResult`` ``{"Error"}``.

Binding: with ``bindVerb: bind`` kube-scheduler leaves the binding to the extender.  With
``[sched] k8s_bind = true`` the service then posts the ``v1.Binding`` to the API server as
kube-scheduler's DefaultBinder does (``POST /api/v1/namespaces/NS/pods/NAME/binding``), in-cluster
by default (``KUBERNETES_SERVICE_HOST``/``_PORT``, the service-account token re-read at every
call since it rotates, its ``ca.crt``), and records the placement only once the API server has
accepted it.  With ``k8s_bind = false`` it only records, and says so in the result's ``Note``
(a key Go's decoder ignores).

Parsing and formatting are pure functions (fuzzed in the tests); the routes
call the same engine, hence the same filter and score plugins, as the live loop
and the simulator.  A bad request is answered in the wire format with ``Error``
set, never with a stack trace.
"""


import asyncio
import logging
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, DecimalException
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from scheduler.model import Job
from scheduler.service.http_checks import BAD_BODY, known_query
from scheduler.service.k8s_api import KubeBinder

log = logging.getLogger("dlshare.sched.k8s")

MAX_EXTENDER_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1: MaxExtenderPriority
MAX_QUANTITY = 2 ** 63  # resource.Quantity is int64-backed (k8s.io/apimachinery): nothing larger is real
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
ANNOTATION_PREFIX = "dlshare.io/"
DEFAULT_CPUS = 0.1  # a container with no CPU request
DEFAULT_MEMORY = 64 << 20  # and no memory request

_SUFFIX = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
           "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1, "k": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
NOT_BOUND_NOTE = ("recorded only: [sched] k8s_bind is false, so no Binding was posted to the API server "
                  "(set k8s_bind = true when kube-scheduler's extender has bindVerb)")
_QTY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


class ExtenderArgs(BaseModel):
    """The body of filter and prioritize, as kube-scheduler marshals ``extenderv1.ExtenderArgs``."""

    model_config = ConfigDict(extra="allow")
    Pod: dict[str, Any] = Field(..., description="the v1.Pod being scheduled")
    Nodes: dict[str, Any] | None = Field(None, description="v1.NodeList of candidates (nodeCacheCapable: false)")
    NodeNames: list[str] | None = Field(None, description="candidate node names (nodeCacheCapable: true)")


class ExtenderBindingArgs(BaseModel):
    model_config = ConfigDict(extra="allow")
    PodName: str
    PodNamespace: str
    PodUID: str = ""
    Node: str


class ExtenderError(ValueError):
    """A request kube-scheduler would not send; answered with ``Error`` set."""


def parse_quantity(q: Any) -> float:
    """A Kubernetes resource quantity (``500m``, ``2``, ``1Gi``, ``1e9``) as a number."""
    if isinstance(q, bool):
        raise ExtenderError(f"quantity {q!r} is not a number")
    if isinstance(q, (int, float)):
        if not (0 <= q <= MAX_QUANTITY):
            raise ExtenderError(f"resource quantity {q!r} must be a finite non-negative number")
        return float(q)
    if not isinstance(q, str):
        raise ExtenderError(f"quantity {q!r} is not a string")
    m = _QTY.match(q.strip())
    if not m:
        raise ExtenderError(f"cannot parse resource quantity {q!r}")
    try:
        val = Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2) or ""])
    except DecimalException:  # InvalidOperation, or Overflow for 1e999999999
        raise ExtenderError(f"cannot parse resource quantity {q[:40]!r}") from None
    if val < 0 or not val.is_finite() or val > MAX_QUANTITY:
        raise ExtenderError(f"resource quantity {q[:40]!r} must be a non-negative number below 2**63")
    return float(val)


@dataclass(frozen=True)
class PodRequest:
    namespace: str
    name: str
    uid: str
    job: dict[str, Any]


def _obj(d: Any, what: str) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ExtenderError(f"{what} must be an object, not {type(d).__name__}")
    return d


def pod_to_job(pod: Any) -> PodRequest:
    """Turn a v1.Pod into the job dict the engine scores: summed container requests
    (limits where a request is missing), GPUs from ``nvidia.com/gpu``, and the model
    from the ``dlshare.io/model`` annotation."""
    pod = _obj(pod, "Pod")
    if not pod:
        raise ExtenderError("ExtenderArgs has no Pod")
    meta = _obj(pod.get("metadata"), "Pod.metadata")
    spec = _obj(pod.get("spec"), "Pod.spec")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ExtenderError("Pod.metadata.name is missing")
    ns = meta.get("namespace") or "default"
    if not isinstance(ns, str):
        raise ExtenderError("Pod.metadata.namespace must be a string")
    cpus = mem = gpus = 0.0
    containers = spec.get("containers") or []
    if not isinstance(containers, list):
        raise ExtenderError("Pod.spec.containers must be a list")
    for i, c in enumerate(containers):
        res = _obj(_obj(c, f"container {i}").get("resources"), f"container {i} resources")
        req = _obj(res.get("requests"), "requests")
        lim = _obj(res.get("limits"), "limits")
        cpus += parse_quantity(req.get("cpu", lim.get("cpu", 0)))
        mem += parse_quantity(req.get("memory", lim.get("memory", 0)))
        for g in GPU_RESOURCES:
            gpus += parse_quantity(lim.get(g, req.get(g, 0)))
    ann = _obj(meta.get("annotations"), "Pod.metadata.annotations")

    def annotation(key: str, kind: type, default: Any) -> Any:
        raw = ann.get(ANNOTATION_PREFIX + key)
        if raw is None:
            return default
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise ExtenderError(f"annotation {ANNOTATION_PREFIX}{key}={raw!r} is not {kind.__name__}") from None

    uid = meta.get("uid") or ""
    job = {
        "id": f"k8s.{ns}.{name}"[:128],
        "spec": {"name": f"{ns}/{name}", "kind": annotation("kind", str, "training"),
                 "model": annotation("model", str, None), "batch_size": annotation("batch-size", int, 1),
                 "gpus": int(round(gpus)), "cpus": cpus or DEFAULT_CPUS, "memory_bytes": int(mem) or DEFAULT_MEMORY,
                 "priority": annotation("priority", int, 0), "command": ["(kubernetes pod)"]},
        "state": "queued", "attained_service": 0.0, "submitted_at": 0.0, "allocation": None,
    }
    return PodRequest(namespace=ns, name=name, uid=str(uid), job=job)


def candidate_names(args: dict[str, Any]) -> tuple[list[str], bool]:
    """Node names from ``NodeNames`` or ``Nodes.items[].metadata.name``; True if sent as names."""
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ExtenderError("NodeNames must be a list of strings")
        return list(names), True
    nodes = _obj(args.get("Nodes"), "Nodes")
    items = nodes.get("items") or []
    if not isinstance(items, list):
        raise ExtenderError("Nodes.items must be a list")
    out = []
    for i, item in enumerate(items):
        name = _obj(_obj(item, f"Nodes.items[{i}]").get("metadata"), "metadata").get("name")
        if not isinstance(name, str) or not name:
            raise ExtenderError(f"Nodes.items[{i}].metadata.name is missing")
        out.append(name)
    return out, False


# Node labels that name a node's GPU generation: NVIDIA GPU Feature Discovery's, then one an operator
# sets by hand (``kubectl label node NAME dlshare.io/gpu-type=v100``).
GPU_TYPE_LABELS = ("nvidia.com/gpu.product", "dlshare.io/gpu-type")


def gpu_type_labels(args: dict[str, Any]) -> dict[str, str]:
    """Node name -> GPU generation, from the labels of the ``Nodes`` kube-scheduler sent (none
    when it sent only names); nodes without such a label are absent."""
    from scheduler.model import gpu_type_of

    out: dict[str, str] = {}
    items = (args.get("Nodes") or {}).get("items") if isinstance(args.get("Nodes"), dict) else None
    for item in items if isinstance(items, list) else ():
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            continue
        labels = meta.get("labels")
        if not isinstance(labels, dict):
            continue
        for key in GPU_TYPE_LABELS:
            t = gpu_type_of(labels[key]) if isinstance(labels.get(key), str) else ""
            if t:
                out[meta["name"]] = t
                break
    return out


def note_gpu_types(service, labels: dict[str, str]) -> None:
    """Keep the labelled generation of each node the service knows; the node's next telemetry
    report carries it to the core when NVML names none.  Runs on the live loop's thread."""
    for name, t in labels.items():
        view = service.nodes.get(name)
        if view is not None:
            view.gpu_type_label = t


def filter_result(args: dict[str, Any], feasible: list[str], failed: dict[str, str], as_names: bool) -> dict[str, Any]:
    """ExtenderFilterResult, echoing the candidates in the form they came."""
    result: dict[str, Any] = {"Nodes": None, "NodeNames": None, "FailedNodes": failed,
                              "FailedAndUnresolvableNodes": {}, "Error": ""}
    if as_names:
        result["NodeNames"] = feasible
    else:
        keep = set(feasible)
        nodes = dict(args.get("Nodes") or {})
        nodes["items"] = [it for it in nodes.get("items") or [] if it["metadata"]["name"] in keep]
        result["Nodes"] = nodes
    return result


def scale_scores(scores: dict[str, float], names: list[str]) -> list[dict[str, Any]]:
    """Engine scores in [0, 1] -> HostPriorityList with integers in 0..MaxExtenderPriority."""
    out = []
    for n in names:
        s = scores.get(n, 0.0)
        s = 0.0 if s != s else min(1.0, max(0.0, s))
        out.append({"Host": n, "Score": int(round(s * MAX_EXTENDER_PRIORITY))})
    return out


def pod_job(pod: PodRequest, now: float) -> Job:
    """The core's Job for a pod (the id names the pod and, when known, its UID: a pod deleted
    and recreated under its name is another job)."""
    from scheduler.service.core_log import spec_job

    jid = pod.job["id"] + (f".{pod.uid[:8]}" if pod.uid else "")
    return spec_job(jid[:128], pod.job["spec"], max(0.0, now))


def evaluate(service, job: dict[str, Any], names: list[str]) -> tuple[list[str], dict[str, str], dict[str, float]]:
    """Feasible nodes, a reason per infeasible one, and scores in [0, 1], from the same core
    (its filters, score plugins and weights) the live loop uses, for GPU and CPU-only pods
    alike.  Runs on the live loop's thread (``service.call``)."""
    from scheduler.service.core_log import spec_job

    failed: dict[str, str] = {}
    online = []
    for n in names:
        view = service.nodes.get(n)
        if view is None:
            failed[n] = "no dlshare node daemon reports from this node"
        elif view.status != "online" or n not in service.core.nodes:
            failed[n] = "the dlshare node daemon on this node is offline"
        else:
            online.append(n)
    probe = spec_job(job["id"], job["spec"], max(0.0, service.core.now))
    best: dict[str, float] = {}
    for cand, total in service.core.candidates(probe, online):
        best[cand.node.node.id] = max(best.get(cand.node.node.id, float("-inf")), total)
    top = max(best.values(), default=0.0)
    scores: dict[str, float] = {}
    why = service.core.explain(probe, [n for n in online if n not in best])
    for n in online:
        if n in best:
            scores[n] = best[n] / top if top > 0 else 1.0
        else:
            failed[n] = f"profile {service.profile}: {why.get(n, 'no placement')}"
    return [n for n in names if n in scores], failed, scores


def add_routes(app: FastAPI, service, auth: list) -> None:
    """Mount the three extender verbs; ``service`` is the SchedulerService."""
    pods: dict[tuple[str, str], PodRequest] = {}
    warned: list[bool] = []

    def remember(pod: PodRequest) -> None:
        pods[(pod.namespace, pod.name)] = pod
        while len(pods) > 10_000:
            pods.pop(next(iter(pods)))

    errors = {**BAD_BODY, 401: {"description": "missing or wrong bearer token"},
              422: {"description": "the body lacks a field kube-scheduler always sends (`detail` says which)"}}

    @app.post("/k8s/filter", dependencies=[*auth, known_query()], tags=["kubernetes"], responses=errors,
              summary="ExtenderArgs -> ExtenderFilterResult (Go field names)")
    async def k8s_filter(body: ExtenderArgs) -> Any:
        args = body.model_dump()
        try:
            pod = pod_to_job(args.get("Pod"))
            names, as_names = candidate_names(args)
        except ExtenderError as exc:
            return JSONResponse({"Nodes": None, "NodeNames": None, "FailedNodes": {},
                                 "FailedAndUnresolvableNodes": {}, "Error": str(exc)})
        remember(pod)
        labels = gpu_type_labels(args)
        if labels:
            await service.call(note_gpu_types, service, labels)
        ok, failed, _ = await service.call(evaluate, service, pod.job, names)
        if ok and getattr(service, "k8s_order", False):
            why = await service.call(order_refusal, service, pod)
            if why:
                failed.update({n: why for n in ok})
                ok = []
        return filter_result(args, ok, failed, as_names)

    @app.post("/k8s/prioritize", dependencies=[*auth, known_query()], tags=["kubernetes"],
              responses={**errors, 400: {"description": "unreadable body, or ExtenderArgs kube-scheduler would not send "
                                                        "(`Error` says which)"}},
              summary="ExtenderArgs -> HostPriorityList [{Host, Score 0..10}]")
    async def k8s_prioritize(body: ExtenderArgs) -> Any:
        args = body.model_dump()
        try:
            pod = pod_to_job(args.get("Pod"))
            names, _ = candidate_names(args)
        except ExtenderError as exc:
            # HostPriorityList has no error field; kube-scheduler treats a non-200 as the extender's error.
            return JSONResponse({"Error": str(exc)}, status_code=400)
        remember(pod)
        labels = gpu_type_labels(args)
        if labels:
            await service.call(note_gpu_types, service, labels)
        _, _, scores = await service.call(evaluate, service, pod.job, names)
        return scale_scores(scores, names)

    @app.post("/k8s/bind", dependencies=[*auth, known_query()], tags=["kubernetes"], responses=errors,
              summary="ExtenderBindingArgs -> ExtenderBindingResult")
    async def k8s_bind(body: ExtenderBindingArgs) -> Any:
        args = body.model_dump()
        pod_name, ns, node = args.get("PodName"), args.get("PodNamespace"), args.get("Node")
        for key, v in (("PodName", pod_name), ("PodNamespace", ns), ("Node", node)):
            if not isinstance(v, str) or not v:
                return {"Error": f"ExtenderBindingArgs.{key} must be a non-empty string"}
        if not await service.call(service.node_online, node):
            return {"Error": f"node {node} has no online dlshare node daemon"}
        binder = service.k8s_binder
        if binder is not None:
            err = await binder(ns, pod_name, str(args.get("PodUID") or ""), node)
            if err:
                return {"Error": err}  # nothing recorded: the pod is not bound
        elif not warned:
            warned.append(True)
            log.warning("kube-scheduler called /k8s/bind but [sched] k8s_bind is false: placements are recorded, "
                        "no Binding is created, so the pods stay Pending")
        pod = pods.get((ns, pod_name)) or PodRequest(
            namespace=ns, name=pod_name, uid=str(args.get("PodUID") or ""),
            job={"id": f"k8s.{ns}.{pod_name}"[:128], "spec": {"name": f"{ns}/{pod_name}", "gpus": 0,
                                                              "cpus": DEFAULT_CPUS, "memory_bytes": DEFAULT_MEMORY}})
        pod = PodRequest(pod.namespace, pod.name, str(args.get("PodUID") or pod.uid), pod.job)
        # A core event (JobBound), logged and replayed like any other: the core holds the pod's
        # resources on the node until its usage shows in the node's figures; kubelet runs it.
        err = await service.call(bind_once, service, pod, node)
        if err:
            return {"Error": err}
        return {"Error": ""} if binder is not None else {"Error": "", "Note": NOT_BOUND_NOTE}


# --- Keeping the core's books equal to the API server's ----------------------------------------

POD_SYNC_S = 1.0  # how often PodSync lists the scheduler's pods


def pod_job_id(namespace: str, name: str, uid: str) -> str:
    """The core's job id for a pod (as :func:`pod_job` makes it)."""
    return (f"k8s.{namespace}.{name}"[:128] + (f".{uid[:8]}" if uid else ""))[:128]


def sync_plan(pods: list[dict[str, Any]], held: Mapping[str, str],
              known: set[str] | frozenset[str] = frozenset()) -> tuple[list[tuple[PodRequest, str]], list[tuple[str, bool]]]:
    """What the core must learn from the API server's pods (``pods``: the scheduler's, from a list):
    ``(to_bind, to_finish)``.  ``held``: the core's active Kubernetes jobs, id -> node; ``known``:
    every job id the core has a record of (a pod it once held and that ended is not bound again).

    * a pod bound to a node and not ended that the core does not hold (kube-scheduler bound it while
      dlshare was down, with ``ignorable``; or dlshare died between the Binding and its record): bind it;
    * a job the core holds whose pod ended (Succeeded/Failed), is gone, or was recreated: finish it
      (failed when the pod failed).  Pure: the tests drive it with the API server's own JSON."""
    live: dict[str, tuple[PodRequest, str]] = {}
    ended: dict[str, bool] = {}
    for p in pods:
        try:
            req = pod_to_job(p)
        except ExtenderError:
            continue  # a pod the extender could not read either: not ours to account
        spec = p.get("spec") if isinstance(p.get("spec"), dict) else {}
        status = p.get("status") if isinstance(p.get("status"), dict) else {}
        node, phase = spec.get("nodeName"), status.get("phase")
        jid = pod_job_id(req.namespace, req.name, req.uid)
        if not isinstance(node, str) or not node:
            continue
        if phase in ("Succeeded", "Failed"):
            ended[jid] = phase == "Failed"
        else:
            live[jid] = (req, node)
    to_bind = [(req, node) for jid, (req, node) in live.items() if jid not in held and jid not in known]
    to_finish = [(jid, ended.get(jid, False)) for jid in held if jid not in live]
    return to_bind, to_finish


def waiting_pods(pods: list[dict[str, Any]]) -> dict[str, tuple[PodRequest, float]]:
    """The pods not bound yet and not ended, job id -> (pod, creation time in epoch seconds)."""
    from datetime import datetime

    out: dict[str, tuple[PodRequest, float]] = {}
    for p in pods:
        spec = p.get("spec") if isinstance(p.get("spec"), dict) else {}
        status = p.get("status") if isinstance(p.get("status"), dict) else {}
        if spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        try:
            req = pod_to_job(p)
        except ExtenderError:
            continue
        try:
            created = datetime.fromisoformat(str(p["metadata"]["creationTimestamp"]).replace("Z", "+00:00")).timestamp()
        except (KeyError, TypeError, ValueError):
            created = 0.0
        out[pod_job_id(req.namespace, req.name, req.uid)] = (req, created)
    return out


def order_refusal(service, pod: PodRequest) -> str:
    """With ``[sched] k8s_order``: why ``pod`` must not be placed now, or "".  kube-scheduler pops its
    own queue (priority, then arrival); the extender imposes dlshare's order by refusing every node to
    a pod while a waiting pod ahead of it in the core's order (its fair-share level, then the order
    plugin's key, as for the core's own queue) fits somewhere now.  A pod ahead that fits nowhere
    does not hold the others back (backfill).  On the loop's thread."""
    from scheduler.model import JobRecord

    pending: dict[str, tuple[PodRequest, float]] = getattr(service, "k8s_waiting", {})
    me = pod_job_id(pod.namespace, pod.name, pod.uid)
    if me not in pending:
        return ""  # not listed yet (the list is a second old): no opinion
    core = service.core
    ctx = core.ledger.context()
    online = [n for n in core.nodes if service.node_online(n)]

    def rec(jid: str) -> JobRecord:
        req, created = pending[jid]
        return JobRecord(job=pod_job(req, created), queued_since=created)

    try:
        mine = core.ledger.sort_key(rec(me), ctx)
        ahead = sorted((core.ledger.sort_key(rec(j), ctx), pending[j][1], j) for j in pending if j != me)
    except (TypeError, ValueError, KeyError):
        return ""
    for key, created, jid in ahead:
        if not key < mine:
            break
        r = rec(jid)
        if any(True for _ in core.candidates(r.job, online)):
            other = pending[jid][0]
            return f"dlshare order: pod {other.namespace}/{other.name} goes first (it fits now)"
    return ""


def held_k8s_jobs(service) -> tuple[dict[str, str], set[str]]:
    """(active Kubernetes jobs -> node, every Kubernetes job id the core knows); on the loop's thread."""
    held: dict[str, str] = {}
    known: set[str] = set()
    for jid, rec in service.core.records.items():
        if not jid.startswith("k8s."):
            continue
        known.add(jid)
        if rec.job.state.active and rec.external:
            held[jid] = rec.shards[0].node if rec.shards else ""
    known |= getattr(service, "k8s_posted", set())
    return held, known


def bind_once(service, pod: PodRequest, node: str) -> str:
    """``service.bind`` unless the core holds the pod already or a bind of it is queued (the bind
    route and :class:`PodSync` may both see one pod).  On the loop's thread."""
    job = pod_job(pod, service.core.now)
    posted = service.__dict__.setdefault("k8s_posted", set())
    if job.id in service.core.records or job.id in posted:
        return ""
    err = service.bind(job, node, pod.uid)
    if not err:
        posted.add(job.id)
        while len(posted) > 100_000:
            posted.pop()
    return err


def apply_sync(service, pods: list[dict[str, Any]], listed_at: float | None = None) -> tuple[int, int]:
    """Apply :func:`sync_plan` to the core (on the loop's thread); (bound, finished).  ``listed_at``:
    the service's clock when the list was asked for; a pod bound since (by ``/k8s/bind``) may be
    missing from the list as bound, so it is not finished on this list's word."""
    from scheduler import JobFinished
    from scheduler.service.core_log import new_event_id

    held, known = held_k8s_jobs(service)
    if listed_at is not None:
        recs = service.core.records
        held = {j: n for j, n in held.items() if (recs[j].run_since or 0.0) < listed_at - 0.5}
    to_bind, to_finish = sync_plan(pods, held, known)
    service.k8s_waiting = waiting_pods(pods)
    bound = 0
    for req, node in to_bind:
        if service.node_online(node) and not bind_once(service, req, node):
            log.info("pod %s/%s runs on node %s without dlshare having bound it: now accounted", req.namespace,
                     req.name, node)
            bound += 1
    for jid, failed in to_finish:
        service.post(JobFinished(new_event_id(), service.now(), jid, failed,
                                 "the pod failed" if failed else "the pod ended"))
    return bound, len(to_finish)


class PodSync:
    """Lists the pods of ``scheduler_name`` from the API server every ``interval_s`` and keeps
    the core's books equal to them (:func:`apply_sync`): a pod that ended frees its GPUs at once
    (no hold to run out), and after a restart of dlshare, or an outage during which kube-scheduler
    bound pods itself (``ignorable: true``), the core holds exactly the pods the API server has on
    each node.  Runs on the API's loop, with the binder's client, token and CA."""

    def __init__(self, service, binder: KubeBinder, scheduler_name: str = "dlshare",
                 interval_s: float = POD_SYNC_S) -> None:
        self.service, self.binder, self.scheduler_name, self.interval_s = service, binder, scheduler_name, interval_s
        self.errors = 0
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line a second for each list

    async def list_pods(self) -> list[dict[str, Any]]:
        headers = {"Accept": "application/json"}
        token = self.binder._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        r = await self.binder._http().get("/api/v1/pods", headers=headers,
                                          params={"fieldSelector": f"spec.schedulerName={self.scheduler_name}"})
        r.raise_for_status()
        items = r.json().get("items")
        return items if isinstance(items, list) else []

    async def once(self) -> tuple[int, int]:
        listed_at = self.service.now()
        pods = await self.list_pods()
        return await self.service.call(apply_sync, self.service, pods, listed_at)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.once()
            except (OSError, ssl.SSLError, httpx.HTTPError, ValueError) as exc:
                self.errors += 1
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    log.warning("cannot list pods from the API server at %s (%d times): %s: %s", self.binder.api_url,
                                self.errors, type(exc).__name__, str(exc)[:200])
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a pod the core refuses must not end the sync for good
                self.errors += 1
                log.exception("pod sync failed; trying again in %g s", self.interval_s)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass
