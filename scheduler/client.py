"""A small client for job launchers: ``SchedulerClient(url, token).submit({...})``.

It speaks the service's HTTP API (``dlshare sched``) with httpx.  Errors come
back as :class:`SchedulerApiError` carrying the HTTP status and the service's own
explanation, e.g. ``422 invalid request: cpus: Input should be greater than 0``.

    from scheduler.client import SchedulerClient
    c = SchedulerClient("http://127.0.0.1:7800", token)
    job = c.submit({"model": "resnet50", "gpus": 1, "cpus": 4, "memory_bytes": 8 << 30,
                    "command": ["python", "train.py"]})
    c.wait(job["id"], {"done", "failed"})
"""

from __future__ import annotations

import functools
import os
import ssl
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from nodesvc.bus import tls

TERMINAL_STATES = frozenset({"done", "failed", "cancelled"})


class SchedulerApiError(RuntimeError):
    """The service answered with an error (``status``), or could not be reached (``status`` 0).
    (``scheduler.SchedulerError`` is the core's: an event it cannot apply.)"""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message


def _explain(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:500] or r.reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        d = body.get("detail")
        if isinstance(d, str):
            return d
        if isinstance(d, list):
            return "; ".join(f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" for e in d if isinstance(e, dict))
    return str(body)[:500]


def _seg(text: str) -> str:
    """One path segment: an id with '/', '?', '#', '..' or control characters names that id, never
    another path or a query."""
    return urllib.parse.quote(str(text), safe="") if text not in (".", "..") else text.replace(".", "%2E")


def _verify(url: str, ca_file: str | None) -> Any:
    """httpx's ``verify`` for ``url``: an https:// API's certificate checked against ``ca_file`` (else
    the system's trust store) and its host name.  ValueError for a URL that is neither http:// nor
    https://, a CA file with http://, or a CA file that cannot be read."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("http", "https"):
        raise ValueError(f"scheduler URL {url!r}: the scheme must be http:// or https://")
    if scheme == "http":
        if ca_file:
            raise ValueError(f"a scheduler CA file ({ca_file!r}) needs an https:// URL, not {url!r}")
        return _system_context()  # never used for a handshake; httpx would build one per client
    return tls.client_context(ca_file, what="scheduler") if ca_file else _system_context()


@functools.lru_cache(maxsize=1)
def _system_context() -> ssl.SSLContext:
    """The system's trust store, loaded once per process: loading it takes about 20 ms, which httpx
    otherwise spends on every new client (a launcher's or a benchmark's client per thread).  The
    clients only read it."""
    return tls.client_context(None, what="scheduler")


def _hint(url: str, exc: httpx.TransportError) -> str:
    """What a TLS failure most likely means, for the error's reader."""
    text = str(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (" (give the CA that signed the API's certificate: --ca-file, sched.ca_file or "
                "DLSHARE_SCHED_CA_FILE)")
    if url.startswith("http://") and isinstance(exc, httpx.RemoteProtocolError):
        return " (if the API serves HTTPS, use an https:// URL)"
    if url.startswith("https://") and ("WRONG_VERSION_NUMBER" in text or "record layer failure" in text):
        return " (the API answered in plain HTTP: use an http:// URL)"
    return ""


class SchedulerClient:
    def __init__(self, url: str, token: str, timeout: float = 10.0, transport: httpx.BaseTransport | None = None,
                 ca_file: str | None = None) -> None:
        """``ca_file``: the CA bundle that signed an https:// API's certificate (default: the system's).
        ValueError for a URL httpx cannot use or a bad TLS setting (see :func:`_verify`)."""
        self.url = url.rstrip("/")
        verify = _verify(self.url, ca_file)
        try:
            self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                     timeout=timeout, transport=transport, verify=verify)
        except httpx.InvalidURL as exc:
            raise ValueError(f"scheduler URL {url!r}: {exc}") from None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "SchedulerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise SchedulerApiError(0, f"cannot reach the scheduler at {self.url}: {exc}"
                                       f"{_hint(self.url, exc)}") from None
        if r.status_code >= 400:
            raise SchedulerApiError(r.status_code, _explain(r))
        return r.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Submit a job spec; returns the stored job (state ``queued``)."""
        return self._call("POST", "/v1/jobs", json=spec)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{_seg(job_id)}")

    def list(self, states: Iterable[str] | None = None, limit: int = 1000, offset: int = 0,
             user: str | None = None) -> list[dict[str, Any]]:
        """Jobs in submission order: the token's user's own (an admin's: everyone's, or ``user``'s)."""
        params: list[tuple[str, Any]] = [("limit", limit), ("offset", offset)]
        params += [("state", s) for s in states or []]
        if user is not None:
            params.append(("user", user))
        return self._call("GET", "/v1/jobs", params=params)["jobs"]

    def all(self, states: Iterable[str] | None = None, page: int = 10_000) -> list[dict[str, Any]]:
        """Every job (in submission order), fetched page by page."""
        out: list[dict[str, Any]] = []
        while True:
            got = self.list(states, limit=page, offset=len(out))
            out += got
            if len(got) < page:
                return out

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/jobs/{_seg(job_id)}")

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{_seg(job_id)}/events", params={"after": after})["events"]

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cluster")

    def whoami(self) -> dict[str, Any]:
        """The token's user, account, whether it is an admin's, and the token's id."""
        return self._call("GET", "/v1/whoami")

    def create_token(self, user: str, account: str = "", admin: bool = False, ttl_s: float = 90 * 86400.0,
                     note: str = "") -> dict[str, Any]:
        """A new token for ``user`` (an admin's call); the answer's ``token`` is shown only once."""
        return self._call("POST", "/v1/tokens", json={"user": user, "account": account, "admin": admin,
                                                       "ttl_s": ttl_s, "note": note})

    def tokens(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/tokens")["tokens"]

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/tokens/{_seg(token_id)}")

    def wait(self, job_id: str, states: Iterable[str] = TERMINAL_STATES, timeout: float = 60.0,
             poll: float = 0.2) -> dict[str, Any]:
        """Poll until the job is in one of ``states``; raises TimeoutError with its last state."""
        want = set(states)
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job["state"] in want:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {job['state']} ({job.get('reason')}) after {timeout}s, "
                                   f"not one of {sorted(want)}")
            time.sleep(poll)


def default_token(db_path: str | None = None) -> str | None:
    """``$DLSHARE_SCHED_TOKEN``, else the token file the service wrote beside its DB."""
    tok = os.environ.get("DLSHARE_SCHED_TOKEN")
    if tok:
        return tok
    if db_path:
        p = Path(db_path + ".token")
        if p.exists():
            return p.read_text().strip() or None
    return None
