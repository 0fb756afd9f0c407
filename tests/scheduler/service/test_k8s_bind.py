"""``/k8s/bind`` creates the pod's binding in the API server, as kube-scheduler's DefaultBinder
does, before it records the placement.  The API server is a fake one over real HTTP(S) on
127.0.0.1 that checks the bearer token, the path and the v1.Binding, and answers as the real one
does: 201, or a metav1.Status with 409, 404, 403, 401; one pod it never answers in time."""

from __future__ import annotations

import json
import logging
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from nodesvc.bus import config
from nodesvc.bus.procs import free_port
from scheduler.service import k8s, k8s_api
from scheduler.service.api import create_app
from tests.scheduler.service.svc_helpers import POD_UID, TOKEN, auth, pod, service_with_nodes

import scheduler.cli.service  # noqa: F401 - registers [sched]

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
UID = POD_UID  # svc_helpers.pod()'s metadata.uid
SA_TOKEN = "eyJhbGciOiJSUzI1NiJ9.sa-token-one"

# A throwaway CA and a certificate for 127.0.0.1 it signed (EC P-256, valid to 2126), for the TLS
# in-cluster path without a certificate library.  Test-only key material; it protects nothing.
CA_PEM = """-----BEGIN CERTIFICATE-----
MIIBmjCCAUGgAwIBAgIULhPvsQ4xgriCmN7ZFkBH07oXFqAwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPZGxzaGFyZS10ZXN0LWNhMCAXDTI2MTEyMTA5MjAzNloYDzIx
MjYxMDI4MDkyMDM2WjAaMRgwFgYDVQQDDA9kbHNoYXJlLXRlc3QtY2EwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAATOpwnw/5niRC6tQp0EkPPzHvU9bAqSzpp5bcl7
W35tDoJTPfFge05VLLmpZJQwkbY0P4r8jkJ1GfnVhBhuWS33o2MwYTAdBgNVHQ4E
FgQUvkGPCDj/1cNjccs3+uLP3WJ0jCMwHwYDVR0jBBgwFoAUvkGPCDj/1cNjccs3
+uLP3WJ0jCMwDwYDVR0TAQH/BAUwAwEB/zAOBgNVHQ8BAf8EBAMCAQYwCgYIKoZI
zj0EAwIDRwAwRAIgRPldH2G/MFdYjvTOO9BwPhV3zigNe7Bpp7renccRjCQCIHKA
zItxMChx2BYQqrpb0oYZ3JTOxnzHixc5cb0a7HxK
-----END CERTIFICATE-----
"""
SERVER_PEM = """-----BEGIN CERTIFICATE-----
MIIBxjCCAWugAwIBAgIUGNJ3lqPxLmrz0MVmBv29+IXO6I4wCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPZGxzaGFyZS10ZXN0LWNhMCAXDTI2MTEyMTA5MjAzNloYDzIx
MjYxMDI4MDkyMDM2WjAUMRIwEAYDVQQDDAkxMjcuMC4wLjEwWTATBgcqhkjOPQIB
BggqhkjOPQMBBwNCAAQSS0LOS2ZllM+58Nwm2fF0oIZY8moBzL58WfGLjvx5iwSx
IcAqp5Mr2HPttBNtcXks9uetxawW9Bzj3qebakRro4GSMIGPMBoGA1UdEQQTMBGH
BH8AAAGCCWxvY2FsaG9zdDAMBgNVHRMBAf8EAjAAMA4GA1UdDwEB/wQEAwIHgDAT
BgNVHSUEDDAKBggrBgEFBQcDATAfBgNVHSMEGDAWgBS+QY8IOP/Vw2Nxyzf64s/d
YnSMIzAdBgNVHQ4EFgQUpTqLP/6dhqrjn7WXhV6HEMACUn4wCgYIKoZIzj0EAwID
SQAwRgIhAIsoRKC+qxxb92YRn5LDBHV5Y/l6+R2UA21+oiuYhnghAiEApWLvpWHA
3uJmO0rK1P66I3KUjW+fVrSZOjl8zZ7f22E=
-----END CERTIFICATE-----
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgHRhu0y5KkuIuV+4G
TNGJt3oD+NFP/3HJVTVEc77UE2ShRANCAAQSS0LOS2ZllM+58Nwm2fF0oIZY8moB
zL58WfGLjvx5iwSxIcAqp5Mr2HPttBNtcXks9uetxawW9Bzj3qebakRr
-----END PRIVATE KEY-----
"""

BINDING_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)/pods/([a-z0-9.-]+)/binding$")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeAPIServer:
    """Pods by (namespace, name) -> {"uid", "node"}; answers POST .../binding like the API server."""

    def __init__(self, tmp: Path, tls: bool) -> None:
        self.token = SA_TOKEN
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def answer(self, code: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                      "content_type": self.headers.get("Content-Type"), "raw": raw})
                if self.headers.get("Authorization") != (None if fake.token is None else f"Bearer {fake.token}"):
                    return self.answer(401, status(401, "Unauthorized", "Unauthorized"))
                m = BINDING_PATH.match(self.path)
                if not m:
                    return self.answer(404, status(404, "NotFound", "the server could not find the requested resource"))
                ns, name = m.groups()
                if self.headers.get("Content-Type") != "application/json":
                    return self.answer(415, status(415, "UnsupportedMediaType", "not json"))
                body = json.loads(raw)
                node = body.get("target", {}).get("name")
                want = {"apiVersion": "v1", "kind": "Binding",
                        "metadata": {"name": name, "namespace": ns, "uid": body.get("metadata", {}).get("uid")},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
                if body != want or not isinstance(node, str) or not node:
                    return self.answer(400, status(400, "BadRequest", f"not a v1.Binding: {body}"))
                if ns == "locked":
                    return self.answer(403, status(403, "Forbidden", f'pods "{name}" is forbidden: User '
                                                   '"system:serviceaccount:dlshare-system:dlshare-sched" cannot create '
                                                   f'resource "pods/binding" in API group "" in the namespace "{ns}"'))
                if name == "slow":
                    fake.release.wait(5.0)
                p = fake.pods.get((ns, name))
                if p is None:
                    return self.answer(404, status(404, "NotFound", f'pods "{name}" not found'))
                if body["metadata"]["uid"] != p["uid"]:
                    return self.answer(409, status(409, "Conflict", f'Operation cannot be fulfilled on pods/binding '
                                                   f'"{name}": Precondition failed: UID in precondition: '
                                                   f'{body["metadata"]["uid"]}, UID in object meta: {p["uid"]}'))
                if p["node"]:
                    return self.answer(409, status(409, "Conflict", f'Operation cannot be fulfilled on pods/binding '
                                                   f'"{name}": pod {name} is already assigned to node "{p["node"]}"'))
                p["node"] = node
                return self.answer(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                         "code": 201})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.port = self.httpd.server_address[1]
        self.ca_file = tmp / "ca.crt"
        self.ca_file.write_text(CA_PEM)
        if tls:
            (tmp / "server.pem").write_text(SERVER_PEM)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tmp / "server.pem")
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def apiserver(tmp_path):
    fake = FakeAPIServer(tmp_path, tls=True)
    yield fake
    fake.close()


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(SA_TOKEN + "\n")
    return p


def extender(store, binder):
    svc = service_with_nodes(store, {"gpu-a": (4, 8), "cpu-c": (0, 4)})
    svc.k8s_binder = binder
    return svc


class Extender:
    """The service's app in a TestClient whose event loop lives as long as the binder's client."""

    def __init__(self, store, binder):
        self.binder = binder
        self.svc = extender(store, binder)
        self.client = TestClient(create_app(self.svc, TOKEN))

    def __enter__(self):
        self.client.__enter__()
        return self

    def __exit__(self, *exc):
        if self.binder is not None:
            self.client.portal.call(self.binder.aclose)
        self.client.__exit__(*exc)

    def schedule(self, name: str, ns: str = "ml", node: str = "cpu-c", uid: str | None = UID) -> dict[str, Any]:
        """kube-scheduler's calls for one pod: filter, then bind (Go field names)."""
        p = pod(name=name, gpus=0, cpu="500m", memory="256Mi", model=None)
        p["metadata"]["namespace"] = ns
        r = self.client.post("/k8s/filter", json={"Pod": p, "NodeNames": [node]}, headers=auth())
        assert r.status_code == 200 and r.json()["Error"] == "" and r.json()["NodeNames"] == [node]
        args = {"PodName": name, "PodNamespace": ns, "PodUID": uid, "Node": node}
        r = self.client.post("/k8s/bind", json=args, headers=auth())
        assert r.status_code == 200
        self.svc.round()  # the bind is a core event, applied in the loop's next round
        return r.json()

    def recorded(self, name: str, ns: str = "ml", node: str = "cpu-c"):
        """The core's record of the bound pod, when it holds the pod on ``node``."""
        rec = self.svc.core.records.get(f"k8s.{ns}.{name}.{UID[:8]}")
        return rec if rec is not None and rec.shards and rec.shards[0].node == node else None

    def bind_events(self) -> list[str]:
        return [e["data"]["pod"] for e in self.svc.store.events() if e["kind"] == "k8s_bind"]


def in_cluster_binder(apiserver: FakeAPIServer, token_file: Path, timeout_s: float = 2.0) -> k8s_api.KubeBinder:
    sched = {**config.defaults()["sched"], "k8s_bind": True, "k8s_token_file": str(token_file),
             "k8s_ca_file": str(apiserver.ca_file), "k8s_timeout_s": timeout_s}
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(apiserver.port)}
    binder = k8s_api.binder_from_config(sched, env=env)
    assert binder is not None and binder.api_url == f"https://127.0.0.1:{apiserver.port}"
    return binder


def test_bind_posts_the_binding_in_cluster_then_records(store, apiserver, token_file, caplog):
    caplog.set_level(logging.DEBUG)
    apiserver.pods[("ml", "p1")] = {"uid": UID, "node": None}
    with Extender(store, in_cluster_binder(apiserver, token_file)) as ext:
        assert ext.schedule("p1") == {"Error": ""}
        (req,) = apiserver.requests
        assert req["path"] == "/api/v1/namespaces/ml/pods/p1/binding"
        assert req["auth"] == f"Bearer {SA_TOKEN}" and req["content_type"] == "application/json"
        assert json.loads(req["raw"]) == {"apiVersion": "v1", "kind": "Binding",
                                          "metadata": {"name": "p1", "namespace": "ml", "uid": UID},
                                          "target": {"apiVersion": "v1", "kind": "Node", "name": "cpu-c"}}
        assert apiserver.pods[("ml", "p1")]["node"] == "cpu-c"
        a = ext.recorded("p1")
        assert a is not None and a.external and a.job.cpus == pytest.approx(0.6)
        assert a.job.memory_bytes == (256 + 64) << 20
        assert ext.bind_events() == [f"k8s.ml.p1.{UID[:8]}"]
    assert SA_TOKEN not in caplog.text and "sa-token" not in repr(ext.binder)


def test_refused_bindings_answer_the_api_servers_reason_and_record_nothing(store, apiserver, token_file):
    apiserver.pods[("ml", "p1")] = {"uid": UID, "node": "gpu-a"}  # another scheduler got there first
    apiserver.pods[("ml", "p2")] = {"uid": "another-uid", "node": None}  # deleted and recreated since filter
    with Extender(store, in_cluster_binder(apiserver, token_file)) as ext:
        err = ext.schedule("p1")["Error"]
        assert err.startswith("binding pod ml/p1 to node cpu-c: the API server answered 409 Conflict (reason Conflict)")
        assert 'already assigned to node "gpu-a"' in err and "already bound" in err
        err = ext.schedule("p2")["Error"]
        assert "409 Conflict" in err and "Precondition failed: UID" in err
        err = ext.schedule("gone")["Error"]
        assert "404 Not Found (reason NotFound)" in err and 'pods "gone" not found' in err and "pod is gone" in err
        err = ext.schedule("p3", ns="locked")["Error"]
        assert "403 Forbidden (reason Forbidden)" in err and 'cannot create resource "pods/binding"' in err
        assert "RBAC" in err and "create on pods/binding" in err
        for name, ns in (("p1", "ml"), ("p2", "ml"), ("gone", "ml"), ("p3", "locked")):
            assert ext.recorded(name, ns) is None
        assert ext.bind_events() == [] and len(apiserver.requests) == 4
        assert all(SA_TOKEN not in ext.schedule(n)["Error"] for n in ("p1", "gone"))


def test_the_token_is_reread_at_every_bind(store, apiserver, token_file):
    apiserver.pods.update({("ml", f"p{i}"): {"uid": UID, "node": None} for i in range(3)})
    with Extender(store, in_cluster_binder(apiserver, token_file)) as ext:
        assert ext.schedule("p0") == {"Error": ""}
        apiserver.token = "rotated-token-two"  # the kubelet projects a new token; the old one expires
        err = ext.schedule("p1")["Error"]
        assert "401 Unauthorized" in err and "refused the token" in err and ext.recorded("p1") is None
        token_file.write_text("rotated-token-two")
        assert ext.schedule("p1") == {"Error": ""} and ext.recorded("p1") is not None
        assert apiserver.requests[-1]["auth"] == "Bearer rotated-token-two"
        token_file.unlink()
        err = ext.schedule("p2")["Error"]
        assert f"cannot read the API token from {token_file}" in err and ext.recorded("p2") is None


def test_timeout_and_connection_refused_are_errors_in_time(store, apiserver, token_file):
    apiserver.pods[("ml", "slow")] = {"uid": UID, "node": None}
    with Extender(store, in_cluster_binder(apiserver, token_file, timeout_s=0.3)) as ext:
        t0 = time.monotonic()
        err = ext.schedule("slow")["Error"]
        assert time.monotonic() - t0 < 4  # the fake holds its answer 5 s: only the 0.3 s timeout ends the call sooner
        assert f"the API server at https://127.0.0.1:{apiserver.port} did not answer within 0.3 s" in err
        assert ext.recorded("slow") is None
    apiserver.release.set()
    dead = f"http://127.0.0.1:{free_port()}"
    with Extender(store, k8s_api.KubeBinder(dead, token_file=str(token_file), timeout_s=1.0)) as ext:
        err = ext.schedule("p1")["Error"]
        assert err.startswith(f"binding pod ml/p1 to node cpu-c: cannot reach the API server at {dead}: ConnectError")
        assert ext.recorded("p1") is None and ext.bind_events() == []


def test_tls_is_verified_against_the_configured_ca(store, apiserver, token_file, tmp_path):
    apiserver.pods[("ml", "p1")] = {"uid": UID, "node": None}
    with Extender(store, k8s_api.KubeBinder(apiserver.url, token_file=str(token_file), ca_file="")) as ext:
        err = ext.schedule("p1")["Error"]  # the system CAs do not know the cluster's CA
        assert "cannot reach the API server" in err and "CERTIFICATE_VERIFY_FAILED" in err
    missing = tmp_path / "no-ca.crt"
    with Extender(store, k8s_api.KubeBinder(apiserver.url, token_file=str(token_file), ca_file=str(missing))) as ext:
        assert f"cannot load the API server's CA from {missing}" in ext.schedule("p1")["Error"]
    assert apiserver.requests == [] and apiserver.pods[("ml", "p1")]["node"] is None


def test_plain_http_api_without_a_token(store, tmp_path):
    """``k8s_api`` overrides in-cluster discovery (e.g. ``kubectl proxy``); ``k8s_token_file = ""`` sends none."""
    fake = FakeAPIServer(tmp_path, tls=False)
    fake.token = None  # the proxy authenticates: any Authorization header is refused (401)
    try:
        fake.pods.update({("ml", "p1"): {"uid": UID, "node": None}, ("ml", "p2"): {"uid": UID, "node": None}})
        sched = {**config.defaults()["sched"], "k8s_bind": True, "k8s_api": fake.url + "/", "k8s_token_file": ""}
        binder = k8s_api.binder_from_config(sched, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
        assert binder.api_url == fake.url
        with Extender(store, binder) as ext:
            assert ext.schedule("p1") == {"Error": ""} and ext.recorded("p1") is not None
            binder.token_file = str(tmp_path / "token-file")  # the check can fail: a token is refused here
            Path(binder.token_file).write_text("t0k")
            assert "401 Unauthorized" in ext.schedule("p2")["Error"] and ext.recorded("p2") is None
        assert [r["auth"] for r in fake.requests] == [None, "Bearer t0k"]
        assert fake.requests[0]["path"] == "/api/v1/namespaces/ml/pods/p1/binding"
        assert fake.pods[("ml", "p1")]["node"] == "cpu-c"
    finally:
        fake.close()


def test_bind_off_only_records_and_says_so(store, apiserver):
    with Extender(store, None) as ext:
        res = ext.schedule("p1")
        assert res["Error"] == "" and "k8s_bind is false" in res["Note"] and "no Binding" in res["Note"]
        assert ext.recorded("p1") is not None and ext.bind_events() == [f"k8s.ml.p1.{UID[:8]}"]
    assert apiserver.requests == []


def test_config_keys_and_in_cluster_discovery():
    cfg = config.load(path=None, env={"DLSHARE_SCHED_K8S_BIND": "true", "DLSHARE_SCHED_K8S_TIMEOUT_S": "2.5"})
    s = cfg["sched"]
    assert s["k8s_bind"] is True and s["k8s_timeout_s"] == 2.5 and s["k8s_api"] == ""
    assert s["k8s_token_file"] == k8s_api.SA_TOKEN == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert s["k8s_ca_file"] == k8s_api.SA_CA == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    assert config.defaults()["sched"]["k8s_bind"] is False
    assert k8s_api.binder_from_config(config.defaults()["sched"], env={}) is None
    b = k8s_api.binder_from_config(s, env={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert b.api_url == "https://[fd00::1]:6443" and b.timeout_s == 2.5
    assert k8s_api.api_server_url("", {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == "https://10.96.0.1:443"
    with pytest.raises(k8s_api.BinderConfigError, match="KUBERNETES_SERVICE_HOST is unset"):
        k8s_api.binder_from_config(s, env={})
    with pytest.raises(k8s_api.BinderConfigError, match="http"):
        k8s_api.api_server_url("kube:6443")
    with pytest.raises(k8s_api.BinderConfigError, match="positive"):
        k8s_api.KubeBinder("https://x", timeout_s=0)


def test_deploy_binds_through_dlshare_with_the_rbac_it_needs():
    ext = yaml.safe_load((DEPLOY / "scheduler-config.yaml").read_text())["extenders"][0]
    # kube-scheduler binds (ignorable does not cover bindVerb); the RBAC below still lets an operator add it
    assert "bindVerb" not in ext
    timeout = float(ext["httpTimeout"].rstrip("s"))
    docs = [d for d in yaml.safe_load_all((DEPLOY / "dlshare-sched.yaml").read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    sa = spec["serviceAccountName"]
    assert spec.get("automountServiceAccountToken", True) is True
    assert ("ServiceAccount", sa) in kinds and kinds[("ServiceAccount", sa)]["metadata"]["namespace"] == "dlshare-system"
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    cfg = config.load(path=None, env={k: v for k, v in env.items() if v is not None})
    assert cfg["sched"]["k8s_bind"] is True and cfg["sched"]["k8s_timeout_s"] < timeout
    # A (Cluster)RoleBinding gives the service account a role with create on pods/binding.
    granted = set()
    for d in docs:
        if d["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == "dlshare-system"
                   for s in d["subjects"]):
            continue
        role = kinds[(d["roleRef"]["kind"], d["roleRef"]["name"])]
        for rule in role["rules"]:
            if "" in rule["apiGroups"]:
                granted |= {(r, v) for r in rule["resources"] for v in rule["verbs"]}
    assert ("pods/binding", "create") in granted and ("pods", "list") in granted  # PodSync lists the pods
