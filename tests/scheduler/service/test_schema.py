"""schemathesis against the service's own OpenAPI spec: no 5xx, every status documented,
responses match their schemas, and a missing or wrong token is always refused."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from scheduler.service.store import JobStore
from tests.scheduler.service.svc_helpers import TOKEN
from nodesvc.bus.messages import telemetry_from

_store = JobStore(":memory:")
_service = SchedulerService(_store, profile="dlshare")
_service.translator.on_telemetry(telemetry_from({"schema": 1, "node": "n1", "ts": 0.0, "cpu": {"count": 4}, "rdma": {},
                       "memory": {"total_bytes": 8 << 30, "available_bytes": 4 << 30},
                       "gpus": {"devices": [{"index": 0}, {"index": 1}]}}))
_service.submit({"id": "secret-job-7f3a", "model": "m", "gpus": 1, "cpus": 1.0, "memory_bytes": 1 << 30, "command": ["x"]})
app = create_app(_service, TOKEN)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
_SPEC = app.openapi()


def _known_query(path: str, method: str) -> set[str]:
    op = _SPEC["paths"].get(path, {}).get(method.lower(), {})
    return {p["name"] for p in op.get("parameters", []) if p.get("in") == "query"}


def _sent_query_keys(query) -> set[str]:
    # What reaches the wire: a key whose value is None or an empty list is not serialised at all.
    return {k for k, v in (query or {}).items() if v is not None and v != []}


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_spec(case):
    excluded = []
    if case.path == "/k8s/prioritize":
        # A v1.Pod is an open object in the spec; a Pod kube-scheduler would never send (say, spec: 5)
        # is answered 400 with the reason in `Error`, which schema-level checks cannot foresee.
        excluded.append(schemathesis.checks.positive_data_acceptance)
    meta = case.meta
    negative = {loc.name.lower() for loc, info in (meta.components.items() if meta else ()) if info.mode.is_negative}
    if meta is not None and meta.generation.mode.is_negative and negative <= {"header"}:
        # No operation takes header parameters: a negative case that mutates only headers mutates the
        # bearer scheme, which the valid token below replaces (wrong tokens: the next test).
        excluded.append(schemathesis.checks.negative_data_rejection)
    elif (meta is not None and meta.generation.mode.is_negative and negative <= {"query", "header"}
          and _sent_query_keys(case.query) <= _known_query(case.path, case.method)):
        # An "additional property" mutation whose extra key has an empty value vanishes when the query is
        # serialised, and the request that goes out is valid (seen: GET /v1/jobs?offset=664&state=...).
        # Value-level query errors are covered by test_svc_api's explicit 422 tests.
        excluded.append(schemathesis.checks.negative_data_rejection)
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=excluded)


@schema.parametrize()
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_refuses_a_wrong_token(case):
    if case.path == "/":
        case.query = {**(case.query or {}), "token": "wrong"}
    r = case.call(headers={"Authorization": "Bearer wrong"})
    if case.path == "/" and case.method.upper() != "GET":
        assert r.status_code == 405  # a method the page does not have
        return
    if case.path == "/":  # a token in its URL is refused (400), its query validated (422), or the form (401)
        assert r.status_code in (400, 401, 422), r.status_code
    else:
        assert r.status_code == 401, (case.method, case.path, r.status_code)
    assert "secret-job-7f3a" not in r.text
