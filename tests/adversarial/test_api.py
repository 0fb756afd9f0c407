"""Attacks on the scheduler's HTTP API: anyone who can reach its port, with or without the token.

One real service process (uvicorn, small ceilings: 1 MiB bodies, 48 connections, 1 s to send a
request) serves every attack of the module.  The ceilings are the README Security section's."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from nodesvc.bus.procs import wait_until
from tests.scheduler.service.svc_helpers import TOKEN, SchedProc, pod

MiB = 1 << 20
LIMITS = {"DLSHARE_SCHED_MAX_BODY_BYTES": str(MiB), "DLSHARE_SCHED_MAX_CONNECTIONS": "48",
          "DLSHARE_SCHED_REQUEST_TIMEOUT_S": "1.0", "DLSHARE_SCHED_KEEP_ALIVE_S": "1.0"}
SPEC = {"command": ["python", "train.py"], "gpus": 0, "cpus": 1.0}


@pytest.fixture(scope="module")
def api(module_mosquitto, tmp_path_factory):
    """The service under attack: a SchedProc (url, port, proc)."""
    svc = SchedProc(tmp_path_factory.mktemp("sched"), module_mosquitto).start(LIMITS)
    wait_until(lambda: _status(svc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == 200, 30, "the API")
    yield svc
    svc.stop()


def _status(port: int, request: bytes, timeout: float = 10.0) -> int | None:
    """Send raw bytes, return the response's status code (None: closed without one)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(request)
            head = s.recv(64)
    except OSError:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None


def _post_head(port: int, length: int, token: bool = True, path: str = "/v1/jobs", extra: bytes = b"") -> bytes:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode() if token else b""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + auth
            + (f"Content-Length: {length}\r\n".encode() if length >= 0 else b"Transfer-Encoding: chunked\r\n")
            + extra + b"\r\n")


def _read_status(s: socket.socket, timeout: float) -> int | None:
    s.settimeout(timeout)
    try:
        head = s.recv(64)
    except OSError:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None


def _rss(svc) -> int:
    return psutil.Process(svc.proc.pid).memory_info().rss


def test_an_oversized_body_is_refused_with_413_before_it_is_read(api):
    """Promise: a request whose Content-Length is over max_body_bytes gets 413 at once, before its
    body is read or parsed.  (Issue 16, failure 7: a 50 MB body was parsed, at +100 MB RSS, for a 422.)"""
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as s:
        s.sendall(_post_head(api.port, 50 * MiB))  # the headers only: the body never comes
        assert _read_status(s, 5) == 413


def test_a_50_mb_body_costs_the_service_no_memory(api):
    """Promise: sending a whole 50 MB body gets 413 and grows the service by less than 8 MiB."""
    rss0 = _rss(api)
    body = b'{"command":["x"],"name":"' + b"a" * (50 * MiB) + b'"}'
    with socket.create_connection(("127.0.0.1", api.port), timeout=20) as s:
        s.sendall(_post_head(api.port, len(body)))
        try:
            s.sendall(body)
        except OSError:
            pass  # the service closed the connection after its 413: it did not want the rest
        assert _read_status(s, 10) == 413
    assert _rss(api) - rss0 < 8 * MiB


def test_a_chunked_body_is_cut_off_at_the_limit(api):
    """Promise: a body sent without a length (chunked) is counted as it is read and refused with 413
    once it passes max_body_bytes; the service holds at most the limit of it."""
    rss0 = _rss(api)
    chunk = b"a" * 65536
    with socket.create_connection(("127.0.0.1", api.port), timeout=20) as s:
        first = b'{"command":["x"],"name":"'
        s.sendall(_post_head(api.port, -1) + b"%x\r\n" % len(first) + first + b"\r\n")
        try:
            for _ in range(64):  # 4 MiB, four times the limit
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        assert _read_status(s, 10) == 413
    assert _rss(api) - rss0 < 8 * MiB


def test_a_body_under_the_limit_is_served(api):
    """Promise: the limit refuses nothing smaller: a valid spec padded to 900 KiB is accepted."""
    body = json.dumps(SPEC).encode()
    body = body[:-1] + b" " * (900 * 1024) + b"}"
    r = httpx.post(f"{api.url}/v1/jobs", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert r.status_code == 201, r.text


def test_a_stalled_or_trickled_request_is_dropped_after_the_request_timeout(api):
    """Promise: a request whose line, headers and body are not all in within request_timeout_s of its
    first byte is dropped (uvicorn alone keeps a half-sent request open forever)."""
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as stalled, \
            socket.create_connection(("127.0.0.1", api.port), timeout=10) as trickle:
        stalled.sendall(b"GET /healthz HTTP/1.1\r\nHost:")
        t0 = time.monotonic()
        closed = False
        for ch in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            try:
                trickle.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            trickle.settimeout(0.2)
            try:
                if trickle.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            except OSError:  # reset: closed with unread bytes in its buffer
                closed = True
                break
        assert closed, "a request trickled over 12 s was kept"
        assert time.monotonic() - t0 < 6
        assert _read_status(stalled, 5) is None  # closed, no response


def test_idle_connections_are_dropped_and_the_api_answers_again(api):
    """Promise: connections that send nothing are dropped within request_timeout_s, so a flood of
    them costs at most max_connections places for that long: the API answers again afterwards
    and its descriptors come back."""
    proc = psutil.Process(api.proc.pid)
    fds0 = proc.num_fds()
    idle = [socket.create_connection(("127.0.0.1", api.port), timeout=10) for _ in range(120)]
    try:
        wait_until(lambda: proc.num_fds() >= fds0 + 100, 10, "the service to accept the flood")
        wait_until(lambda: proc.num_fds() <= fds0 + 2, 10, "the idle connections to be dropped")
        assert _status(api.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == 200
    finally:
        for s in idle:
            s.close()


def test_connections_over_the_cap_get_503_and_threads_stay_bounded(api):
    """Promise: beyond max_connections concurrent connections, requests get 503 (not a queue that
    grows); the service's threads stay within its pools (anyio's 40, asyncio's executor) however
    many connect."""
    proc = psutil.Process(api.proc.pid)
    threads0 = proc.num_threads()
    held = [socket.create_connection(("127.0.0.1", api.port), timeout=10) for _ in range(60)]
    try:
        for s in held:
            s.sendall(b"GET /v1/cluster HTTP/1.1\r\nHost: x\r\n")  # headers not finished: each holds a place
        codes = []
        results = []

        def get() -> None:
            results.append(_status(api.port, f"GET /v1/cluster HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                                             f"\r\n\r\n".encode()))

        workers = [threading.Thread(target=get) for _ in range(20)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        codes = set(results)
        assert 503 in codes, codes
        assert proc.num_threads() <= threads0 + 48
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("field,value", [("graph_features.flops", 1e308), ("graph_features.params", 1e300),
                                         ("graph_features.conv_frac", 1e6), ("graph_features.layers", 1e200),
                                         ("graph_features.activation_bytes", 1e300), ("cpus", 1e308),
                                         ("memory_bytes", 10 ** 30), ("batch_size", 10 ** 30)])
def test_every_number_of_a_job_spec_has_finite_bounds(api, field, value):
    """Promise: every number in a job spec is bounded; 1e308 FLOPs or a 1e6 layer fraction is a 422
    naming the field, and nothing reaches the queue."""
    spec = json.loads(json.dumps(SPEC))
    if field.startswith("graph_features."):
        spec["graph_features"] = {field.split(".")[1]: value}
    else:
        spec[field] = value
    r = httpx.post(f"{api.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 422, r.text
    assert field.split(".")[-1] in r.text


@pytest.mark.parametrize("raw", [b"job%0A", b"job%0D", b"..", b"a%2Fb", b"j%00"])
def test_job_ids_with_control_characters_are_refused(api, raw):
    """Promise: a job id with a newline, NUL, slash or dot-start in the path gets 422 or 404, never a
    server error."""
    code = _status(api.port, b"GET /v1/jobs/" + raw + f" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
                                                      f"\r\n\r\n".encode())
    assert code in (404, 422), code


@pytest.mark.parametrize("cpu", ["1e400", "1e999999999", "9" * 400, "1e308Ei"])
def test_absurd_pod_quantities_are_extender_errors(api, cpu):
    """Promise: a pod whose resource quantity overflows (1e400, 1e999999999) is answered in the
    extender's wire format with Error set, not a 500 or an infinite request."""
    args = {"Pod": pod(cpu=cpu), "NodeNames": ["n1"]}
    r = httpx.post(f"{api.url}/k8s/filter", json=args, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code in (200, 400), r.text
    assert "quantity" in r.json()["Error"], r.text


def test_oversized_headers_are_refused(api):
    """Promise: the service buffers at most 16 KiB of a header block still incomplete (uvicorn's h11
    limit; one read of up to 256 KiB is parsed whole): past it, a 400 at once, not a wait."""
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)  # never finished
        assert _read_status(s, 5) == 400
    assert _status(api.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == 200
