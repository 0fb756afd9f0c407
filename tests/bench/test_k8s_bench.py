"""bench/k8s.py's pieces without a control plane: the scaled slice and the timing proxy."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench import k8s as bk


def test_scaled_slice_fits_the_nodes_spans_the_arrivals_and_asks_the_load():
    trace, a_scale, d_scale = bk.scaled_trace(40, 60.0, 1.5, 0.0, nodes=2)
    assert len(trace) == 40 and all(1 <= t.gpus <= bk.GPUS for t in trace)
    assert trace[0].arrival_s == 0.0 and abs(max(t.arrival_s for t in trace) - 60.0) < 1e-6
    assert abs(sum(t.gpus * t.duration_s for t in trace) / (60.0 * 2 * bk.GPUS) - 1.5) < 1e-9
    assert 0 < a_scale < 1 and 0 < d_scale < 1


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, json.loads(r.read())
    c.close()
    return out


def test_timing_proxy_forwards_times_by_verb_and_answers_502_when_the_extender_is_down():
    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"path": self.path, "got": json.loads(body)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    t = threading.Thread(target=upstream.serve_forever, daemon=True)
    t.start()
    proxy = bk.TimingProxy(upstream.server_address[1]).start()
    try:
        assert post(proxy.port, "/k8s/filter", {"Pod": 1}) == (200, {"path": "/k8s/filter", "got": {"Pod": 1}})
        post(proxy.port, "/k8s/prioritize", {})
        post(proxy.port, "/k8s/filter", {})
        assert {v: len(x) for v, x in proxy.times.items()} == {"filter": 2, "prioritize": 1}
        assert all(ms > 0 for x in proxy.times.values() for ms in x)
        upstream.shutdown()
        upstream.server_close()
        status, body = post(proxy.port, "/k8s/filter", {})
        assert status == 502 and "unreachable" in body["Error"] and proxy.failed == 1
    finally:
        proxy.stop()
