"""The Kubernetes API server as the scheduler extender sees it: where it is, and the one write it makes
(a pod's ``v1.Binding``, when ``[sched] k8s_bind`` is true), with the service account's token and CA.

Split from :mod:`scheduler.service.k8s` (the extender's wire format, routes and pod sync), which uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

log = logging.getLogger("dlshare.sched.k8s")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SA_TOKEN = f"{SA_DIR}/token"
SA_CA = f"{SA_DIR}/ca.crt"


class BinderConfigError(ValueError):
    """``[sched] k8s_*`` settings that cannot reach an API server."""


def api_server_url(api: str = "", env: Mapping[str, str] | None = None) -> str:
    """``api`` if set, else the in-cluster address from ``KUBERNETES_SERVICE_HOST``/``_PORT``."""
    if api:
        if not api.startswith(("https://", "http://")):
            raise BinderConfigError(f"sched.k8s_api must be an http(s):// URL, not {api!r}")
        return api.rstrip("/")
    env = os.environ if env is None else env
    host = env.get("KUBERNETES_SERVICE_HOST", "").strip()
    if not host:
        raise BinderConfigError("sched.k8s_bind is on but sched.k8s_api is empty and KUBERNETES_SERVICE_HOST is "
                                "unset (not in a pod): set sched.k8s_api to the API server's URL")
    port = env.get("KUBERNETES_SERVICE_PORT", "").strip() or "443"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 service address
    return f"https://{host}:{port}"


def binding_body(namespace: str, name: str, uid: str, node: str) -> dict[str, Any]:
    """The v1.Binding kube-scheduler's DefaultBinder posts; ``uid`` makes the API server refuse
    (409) a pod that was deleted and recreated under the same name since it was scheduled."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid  # Go's omitempty
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


_HINTS = {401: "the API server refused the token (sched.k8s_token_file)",
          403: "RBAC: the service account needs create on pods/binding (deploy/kubernetes/dlshare-sched.yaml)",
          404: "the pod is gone",
          409: "the pod is already bound, or was recreated with another UID"}


class KubeBinder:
    """Creates a pod's binding in the API server; ``await binder(ns, pod, uid, node)`` returns
    ``""`` once the API server accepted it, else the reason.  The token is never logged."""

    def __init__(self, api_url: str, token_file: str = SA_TOKEN, ca_file: str = SA_CA,
                 timeout_s: float = 4.0) -> None:
        if not timeout_s > 0:
            raise BinderConfigError(f"sched.k8s_timeout_s must be positive, not {timeout_s!r}")
        self.api_url = api_url.rstrip("/")
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout_s = float(timeout_s)
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"KubeBinder({self.api_url!r}, token_file={self.token_file!r}, ca_file={self.ca_file!r})"

    def _token(self) -> str:
        if not self.token_file:
            return ""
        with open(self.token_file, encoding="utf-8") as f:  # re-read: projected tokens rotate
            return f.read().strip()

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            verify: ssl.SSLContext | bool = True
            if self.api_url.startswith("https://") and self.ca_file:
                verify = ssl.create_default_context(cafile=self.ca_file)
            self._client = httpx.AsyncClient(base_url=self.api_url, verify=verify, trust_env=False,
                                             timeout=httpx.Timeout(self.timeout_s))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __call__(self, namespace: str, name: str, uid: str, node: str) -> str:
        what = f"binding pod {namespace}/{name} to node {node}"
        try:
            token = self._token()
        except OSError as exc:
            return f"{what}: cannot read the API token from {self.token_file}: {exc.strerror or exc}"
        try:
            client = self._http()
        except (OSError, ssl.SSLError) as exc:
            return f"{what}: cannot load the API server's CA from {self.ca_file}: {exc}"
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/binding"
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await client.post(path, json=binding_body(namespace, name, uid, node), headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            log.warning("%s: the API server at %s did not answer within %g s", what, self.api_url, self.timeout_s)
            return (f"{what}: the API server at {self.api_url} did not answer within {self.timeout_s:g} s "
                    f"(the binding may or may not exist)")
        except httpx.HTTPError as exc:
            log.warning("%s: cannot reach the API server at %s: %s", what, self.api_url, type(exc).__name__)
            return f"{what}: cannot reach the API server at {self.api_url}: {type(exc).__name__}: {exc}"
        if 200 <= r.status_code < 300:
            log.info("bound pod %s/%s to node %s", namespace, name, node)
            return ""
        reason, message = "", r.text.strip()
        try:
            status = r.json()  # a metav1.Status
            if isinstance(status, dict):
                reason = str(status.get("reason") or "")
                message = str(status.get("message") or message)
        except ValueError:
            pass
        message = " ".join(message.split())[:400]
        err = f"{what}: the API server answered {r.status_code} {r.reason_phrase}"
        if reason:
            err += f" (reason {reason})"
        if message:
            err += f": {message}"
        if r.status_code in _HINTS:
            err += f" [{_HINTS[r.status_code]}]"
        log.warning("%s", err)
        return err


def binder_from_config(sched: Mapping[str, Any], env: Mapping[str, str] | None = None) -> KubeBinder | None:
    """The binder ``[sched]`` asks for: None unless ``k8s_bind``."""
    if not sched.get("k8s_bind"):
        return None
    return KubeBinder(api_server_url(sched.get("k8s_api", ""), env), token_file=sched.get("k8s_token_file", SA_TOKEN),
                      ca_file=sched.get("k8s_ca_file", SA_CA), timeout_s=sched.get("k8s_timeout_s", 4.0))
