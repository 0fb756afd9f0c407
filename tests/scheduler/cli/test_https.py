"""The scheduler's HTTP API over HTTPS (``dlshare sched --tls-cert-file --tls-key-file``), as real
processes: the job and token commands with ``--ca-file``, a wrong CA, a wrong host name and a plain
client refused with the reason and without the token, the status page's cookie marked Secure, the
URL the service publishes, the extender opened by a client certificate (``--k8s-client-ca-file``)
and nothing else by it, and every bad TLS setting a config error before anything listens.
(The Kubernetes extender and Prometheus scrape it over HTTPS in tests/k8s and tests/deploy.)"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodesvc.bus.procs import free_port, wait_until
from scheduler.client import SchedulerApiError, SchedulerClient
from tests.scheduler.service.svc_helpers import ROOT, TOKEN, SchedProc, node_list, pod
from tests.tls_certs import make_test_pki


def _dlshare(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodesvc.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _job_list(monkeypatch, capsys, url: str, ca: str) -> tuple[int, str, str]:
    """``dlshare job list`` in this process (the commands themselves run as processes above)."""
    from nodesvc.cli import main

    for name, value in (("DLSHARE_SCHED_URL", url), ("DLSHARE_SCHED_TOKEN", TOKEN), ("DLSHARE_SCHED_CA_FILE", ca)):
        monkeypatch.setenv(name, value)
    rc = main(["job", "list"])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def https_sched(pki, tmp_path_factory):
    """One HTTPS service for the module's tests that need no broker (they only talk to its API); it asks
    clients for a certificate (``k8s_client_ca_file``), which clients without one do not notice."""
    sched = SchedProc(tmp_path_factory.mktemp("https"), "", profile="fifo", tls=pki).start(
        {"DLSHARE_SCHED_K8S_CLIENT_CA_FILE": str(pki / "client-ca.pem")})
    yield sched
    sched.stop()


def test_the_job_and_token_commands_work_over_https_with_the_ca(pki, mosquitto, tmp_path):
    https_sched = SchedProc(tmp_path, mosquitto.url, profile="fifo", tls=pki).start()
    try:
        _commands_over_https(https_sched, pki, mosquitto)
    finally:
        https_sched.stop()


def _commands_over_https(https_sched, pki, mosquitto) -> None:
    env = {"DLSHARE_SCHED_URL": https_sched.url, "DLSHARE_SCHED_TOKEN": TOKEN,
           "DLSHARE_SCHED_CA_FILE": str(pki / "ca.pem")}
    r = _dlshare("job", "submit", "--id", "tls-1", "--gpus", "1", "--", "python", "train.py", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tls-1", "queued"]
    # --ca-file on the command line gives the same
    r = _dlshare("job", "--ca-file", str(pki / "ca.pem"), "list", env={**env, "DLSHARE_SCHED_CA_FILE": ""})
    assert r.returncode == 0 and "tls-1" in r.stdout, r.stderr
    r = _dlshare("token", "create", "alice", "--account", "vision", env=env)
    assert r.returncode == 0, r.stderr
    with SchedulerClient(https_sched.url, r.stdout.split()[-1], ca_file=str(pki / "ca.pem")) as alice:
        assert alice.whoami()["user"] == "alice"
    # the service publishes its https:// URL, which `dlshare status` shows
    from nodesvc.cli import status

    def url():
        doc = status.summarize(asyncio.run(status.gather(mosquitto.url)))
        return next((s["url"] for s in doc["schedulers"] if s["status"] == "online"), None)

    assert wait_until(url, 30, "the scheduler online in dlshare status") == https_sched.url


@pytest.mark.parametrize("how, says", [
    ("other-ca", "CERTIFICATE_VERIFY_FAILED"),
    ("system-store", "CERTIFICATE_VERIFY_FAILED"),
    ("localhost", "CERTIFICATE_VERIFY_FAILED"),  # the certificate names 127.0.0.1 only
    ("http", "if the API serves HTTPS, use an https:// URL"),
])
def test_a_client_that_cannot_trust_the_api_is_refused_with_the_reason_and_without_the_token(https_sched, pki,
                                                                                              how, says, monkeypatch,
                                                                                              capsys):
    url, ca = https_sched.url, str(pki / "ca.pem")
    if how == "other-ca":
        ca = str(pki / "other-ca.pem")
    elif how == "system-store":
        ca = ""
    elif how == "localhost":
        url = url.replace("127.0.0.1", "localhost")
    elif how == "http":
        url, ca = url.replace("https://", "http://"), ""
    rc, out, err = _job_list(monkeypatch, capsys, url, ca)
    assert rc == 1, (out, err)
    assert "cannot reach the scheduler" in err and says in err, err
    if how != "http":
        assert "--ca-file" in err, err  # the hint
    assert TOKEN not in err + out and "Traceback" not in err


def test_a_stalled_handshake_and_a_plain_request_do_not_stop_the_api(https_sched, pki):
    """A peer that connects and never starts TLS, and one that speaks plain HTTP to the TLS port, get
    nothing; the API serves the next client as before."""
    stalled = socket.create_connection(("127.0.0.1", https_sched.port), timeout=10)
    try:
        plain = socket.create_connection(("127.0.0.1", https_sched.port), timeout=10)
        plain.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        got = b""
        while chunk := plain.recv(4096):  # the server ends the connection: no HTTP answer to plain text
            got += chunk
        plain.close()
        assert b"HTTP/1.1 200" not in got and b"jobs" not in got, got[:200]
        with https_sched.client() as c:
            assert c.list() == []
            assert c.cluster()["nodes"] == []
    finally:
        stalled.close()


def test_the_status_pages_cookie_is_secure_over_https(https_sched, pki):
    with httpx.Client(base_url=https_sched.url, verify=ssl.create_default_context(cafile=str(pki / "ca.pem")),
                      timeout=10) as page:
        r = page.post("/login", content=f"token={TOKEN}", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 303, r.text
        cookie = r.headers["set-cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie, cookie
        assert page.get("/").status_code == 200  # the cookie logs the page in


def test_a_client_certificate_opens_the_extender_and_nothing_else(https_sched, pki):
    """kube-scheduler's extender client sends a certificate, never a token: one signed by
    sched.k8s_client_ca_file may call /k8s/*, and nothing else; one signed by another CA is refused in
    the handshake; without either, /k8s/* wants a token as before."""
    body = {"Pod": pod("train-0", gpus=1), "Nodes": node_list("n1"), "NodeNames": None}
    def client(cert: str | None = None) -> httpx.Client:  # a context each: httpx loads the certificate into it
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        if cert:
            ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
        return httpx.Client(base_url=https_sched.url, verify=ctx, timeout=10)

    with client("client") as kube:
        r = kube.post("/k8s/filter", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["FailedNodes"] == {"n1": r.json()["FailedNodes"]["n1"]}  # no daemon reports from n1
        r = kube.post("/k8s/prioritize", json=body)
        assert r.status_code == 200 and r.json() == [{"Host": "n1", "Score": 0}], r.text
        for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/cluster"), ("GET", "/metrics"),
                             ("POST", "/v1/tokens")):
            r = kube.request(method, path, json={"user": "eve"} if method == "POST" else None)
            assert r.status_code == 401, (path, r.status_code, r.text)
    with client() as anon:
        r = anon.post("/k8s/filter", json=body)
        assert r.status_code == 401 and "bearer token" in r.text, r.text
    with client("stranger") as stranger:
        with pytest.raises(httpx.TransportError):
            stranger.post("/k8s/filter", json=body)
    with https_sched.client() as c:  # and token clients go on as before
        assert c.whoami()["admin"]


def _sched_fails(tmp_path, *args: str) -> str:
    port = free_port()
    r = _dlshare("sched", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "sched.db"), "--broker", "",
                 *args, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "config error" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(OSError):  # nothing listened
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return r.stderr


def test_bad_tls_settings_are_config_errors_before_anything_listens(pki, tmp_path):
    # as a process: exit 2, a config error, no traceback, nothing listening
    assert "go together" in _sched_fails(tmp_path, "--tls-cert-file", str(pki / "server.pem"))
    err = _sched_fails(tmp_path, "--tls-cert-file", str(pki / "server.pem"),
                       "--tls-key-file", str(pki / "other-ca.key"))
    assert "server.pem" in err and "other-ca.key" in err  # a key that is not the certificate's
    # every other case through the same check, in this process
    from nodesvc.bus import config
    from scheduler.cli.service import tls_files

    def fails(**given: str) -> str:
        s = {"tls_cert_file": "", "tls_key_file": "", "k8s_client_ca_file": "", **given}
        with pytest.raises(config.ConfigError) as err:
            tls_files(s)
        return str(err.value)

    (tmp_path / "not.pem").write_text("not a certificate\n")
    assert "go together" in fails(tls_key_file=str(pki / "server.key"))
    assert "missing.pem" in fails(tls_cert_file=str(tmp_path / "missing.pem"), tls_key_file=str(pki / "server.key"))
    assert "not.pem" in fails(tls_cert_file=str(tmp_path / "not.pem"), tls_key_file=str(pki / "server.key"))
    assert "needs HTTPS" in fails(k8s_client_ca_file=str(pki / "client-ca.pem"))
    err = fails(tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                k8s_client_ca_file=str(tmp_path / "not.pem"))
    assert "sched.k8s_client_ca_file" in err and "not.pem" in err
    assert tls_files({"tls_cert_file": str(pki / "server.pem"), "tls_key_file": str(pki / "server.key"),
                      "k8s_client_ca_file": str(pki / "client-ca.pem")}) == (
        str(pki / "server.pem"), str(pki / "server.key"), str(pki / "client-ca.pem"))


@pytest.mark.parametrize("url, ca, says", [
    ("https://127.0.0.1:1", "/nonexistent/ca.pem", "/nonexistent/ca.pem"),
    ("http://127.0.0.1:1", "CA", "needs an https:// URL"),
    ("ftp://127.0.0.1:1", "", "must be http:// or https://"),
    ("127.0.0.1:7800", "", "must be http:// or https://"),
])
def test_a_bad_client_setting_is_a_config_error_naming_it(pki, url, ca, says, monkeypatch, capsys):
    ca = str(pki / "ca.pem") if ca == "CA" else ca
    rc, out, err = _job_list(monkeypatch, capsys, url, ca)
    assert rc == 2 and says in err and "Traceback" not in err, (rc, err)
    assert TOKEN not in err + out


def test_the_default_url_follows_the_certificate(pki):
    from nodesvc.bus import config
    from scheduler.cli.jobs import api_client_url as _url
    from scheduler.cli.service import api_url

    cfg = config.load(None, env={})
    cfg["sched"].update(listen="0.0.0.0:7443", tls_cert_file=str(pki / "server.pem"))
    assert _url(cfg) == "https://127.0.0.1:7443"
    cfg["sched"].update(listen="[::1]:7443")
    assert _url(cfg) == "https://[::1]:7443"
    cfg["sched"].update(tls_cert_file="")
    assert _url(cfg) == "http://[::1]:7443"
    assert api_url("10.0.0.5", 7443, https=True) == "https://10.0.0.5:7443"
    with pytest.raises(SchedulerApiError) as err:  # nothing listens there: reported, not raised raw
        SchedulerClient(f"https://127.0.0.1:{free_port()}", TOKEN, ca_file=str(pki / "ca.pem")).list()
    assert err.value.status == 0


def test_an_https_client_at_a_plain_http_port_is_told_so(pki):
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # noqa: ANN002 - the handshake's bytes are not worth a line
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with SchedulerClient(f"https://127.0.0.1:{srv.server_port}", TOKEN, ca_file=str(pki / "ca.pem")) as c:
            with pytest.raises(SchedulerApiError) as err:
                c.list()
    finally:
        srv.shutdown()
        srv.server_close()
    assert err.value.status == 0 and "use an http:// URL" in str(err.value), err.value
    assert TOKEN not in str(err.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.builds(lambda s, r: f"{s}://{r}", st.sampled_from(["http", "HTTPS", "ftp", ""]),
                                        st.text(max_size=30)),
       st.none() | st.sampled_from(["", "/nonexistent/ca.pem"]))
def test_any_url_and_ca_setting_gives_a_client_or_a_value_error(url, ca):
    try:
        c = SchedulerClient(url, TOKEN, ca_file=ca)
    except ValueError as exc:
        assert TOKEN not in str(exc)
        return
    c.close()
    assert url.split("://", 1)[0].lower() in ("http", "https") and not (ca and url.lower().startswith("http:"))


def test_a_renewed_certificate_is_served_without_a_restart(pki, tmp_path):
    """The files replaced (by another CA's certificate, as a renewal that changes CA would): new
    connections get the new certificate within a reload period; a broken pair is logged and the
    certificate loaded before goes on serving."""
    import shutil

    from tests.tls_certs import make_signed

    d = tmp_path / "live"
    d.mkdir()
    for f in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(pki / f, d / f)
    sched = SchedProc(tmp_path, "", profile="fifo", tls=d).start({"DLSHARE_SCHED_TLS_RELOAD_S": "0.2"})
    log = tmp_path / f"sched-{sched.port}.log"
    try:
        def works(ca: str) -> bool:
            with SchedulerClient(sched.url, TOKEN, ca_file=str(pki / ca)) as c:
                try:
                    return c.whoami()["admin"]
                except SchedulerApiError:
                    return False

        assert works("ca.pem") and not works("other-ca.pem")
        # a half-done renewal: a new certificate beside the old key is refused, the old pair serves on
        make_signed(pki, "other-ca", "renewed", "IP:127.0.0.1")
        shutil.copy(pki / "renewed.pem", d / "server.pem.new")
        os.replace(d / "server.pem.new", d / "server.pem")
        wait_until(lambda: "still serving the certificate loaded before" in log.read_text(), 30,
                   "the mismatched pair logged")
        assert works("ca.pem")
        # the key follows: the new pair is served
        shutil.copy(pki / "renewed.key", d / "server.key.new")
        os.replace(d / "server.key.new", d / "server.key")
        wait_until(lambda: works("other-ca.pem"), 30, "the renewed certificate served")
        assert not works("ca.pem") and "loaded the renewed certificate" in log.read_text()
    finally:
        sched.stop()
