"""A real Kubernetes control plane for the extender's end-to-end tests, one per session:
etcd, kube-apiserver and kube-scheduler 1.20 (built by ``make k8s-testbed``), the shipped
``deploy/kubernetes/scheduler-config.yaml`` turned into v1beta1, a real ``dlshare sched`` serving
the extender over HTTPS (as the shipped file's comments say to, with certificates made here:
kube-scheduler authenticates with its client certificate, no ``k8s_open``) and binding through the
API server, real ``dlshare node`` daemons (fake GPUs) named as
the Kubernetes nodes, and the pod-lifecycle driver in place of kubelets.

Without the binaries the tests fail under CI (``CI=true``) naming the build, and skip elsewhere
with the same message, so a broken build can never pass as green."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from scheduler.service import k8s_testbed as tb
from tests.tls_certs import make_test_pki

# kn3 has the most GPUs but no dlshare node daemon: kube-scheduler alone would use it, dlshare filters it out.
NODES = {"kn1": 4, "kn2": 4}
KUBE_NODES = {**NODES, "kn3": 8}


@dataclass
class K8s:
    kube: tb.LocalKube
    dlshare: tb.Dlshare
    driver: tb.PodDriver
    api: tb.Kube
    config: dict[str, Any]

    def restart_scheduler(self) -> None:
        self.kube.start_scheduler(self.config)


def _binaries_or_fail() -> None:
    try:
        tb.find_binaries()
    except tb.TestbedError as exc:
        msg = f"the Kubernetes test control plane is missing: {exc}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("DLSHARE_K8S_REQUIRED"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


def with_https(config: dict[str, Any], pki: Any) -> dict[str, Any]:
    """The extender called over HTTPS, its certificate checked against the CA, kube-scheduler's own
    client certificate sent: the settings deploy/kubernetes/scheduler-config.yaml gives in its
    comments for a service with a certificate (``pki``: tests/tls_certs.py's files)."""
    shipped = (tb.DEPLOY / "scheduler-config.yaml").read_text()
    for line in ("#   enableHTTPS: true", "#   tlsConfig:", "#     caFile:", "#     certFile:", "#     keyFile:"):
        assert line in shipped, f"scheduler-config.yaml no longer says how to call the extender over HTTPS: {line}"
    for ext in config["extenders"]:
        assert ext["urlPrefix"].startswith("https://"), ext
        ext["enableHTTPS"] = True
        ext["tlsConfig"] = {"caFile": str(pki / "ca.pem"), "certFile": str(pki / "client.pem"),
                            "keyFile": str(pki / "client.key")}
    return config


@pytest.fixture(scope="session")
def k8s(tmp_path_factory):
    _binaries_or_fail()
    root = tmp_path_factory.mktemp("k8s")
    kube = tb.LocalKube(root / "kube")
    dl = driver = api = None
    try:
        kube.start()
        api = kube.client()
        for name, gpus in KUBE_NODES.items():
            api.create_node(name, gpus)
        pki = make_test_pki(root / "pki")
        dl = tb.Dlshare(root / "dlshare", kube, NODES, tls=(pki / "server.pem", pki / "server.key", pki / "ca.pem"),
                        client_ca=pki / "client-ca.pem").start()
        shipped = yaml.safe_load((tb.DEPLOY / "scheduler-config.yaml").read_text())
        config = with_https(tb.v1beta1_config(shipped, dl.extender_url, kube.kubeconfig), pki)
        kube.start_scheduler(config)
        driver = tb.PodDriver(kube).start()
        yield K8s(kube, dl, driver, api, config)
    finally:
        if driver is not None:
            driver.stop()
        if api is not None:
            api.close()
        if dl is not None:
            dl.stop()
        kube.stop()
