"""The HTTP API in-process (FastAPI TestClient): auth, validation, idempotent submission, views."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from tests.scheduler.service.svc_helpers import TOKEN, auth

GOOD = {"name": "resnet", "model": "resnet50", "gpus": 1, "cpus": 2, "memory_bytes": 2 << 30,
        "command": ["python", "train.py"]}


@pytest.fixture
def api(store):
    svc = SchedulerService(store, profile="dlshare")
    with TestClient(create_app(svc, TOKEN)) as c:
        yield c, svc


def test_token_is_required_and_checked(api):
    c, _ = api
    r = c.get("/v1/jobs")
    assert r.status_code == 401 and "bearer" in r.json()["detail"]
    r = c.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["detail"] == "wrong bearer token"
    assert c.get("/v1/jobs", headers=auth()).status_code == 200
    assert c.get("/").status_code == 401
    assert c.get("/", headers=auth()).status_code == 200  # a proxy in front may add the header
    assert c.get("/openapi.json").status_code == 200


def test_the_page_keeps_the_token_in_an_httponly_strict_cookie_never_in_a_url(api):
    """Promise: the status page asks for the token once and keeps it in an HttpOnly, SameSite=Strict
    cookie; a token in a URL is refused (not used); the cookie opens only the page, not the API; a
    form posted from another site is refused; logging out forgets it."""
    c, _ = api
    r = c.get(f"/?token={TOKEN}")
    assert r.status_code == 400 and "not accepted here" in r.text and "set-cookie" not in r.headers
    assert TOKEN not in r.text
    r = c.post("/login", data={"token": "nope"})
    assert r.status_code == 401 and "not accepted: wrong bearer token" in r.text and "set-cookie" not in r.headers
    for other_site in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site", "Origin": "null"},
                       {"Sec-Fetch-Site": "same-site"}):
        r = c.post("/login", data={"token": TOKEN}, headers=other_site, follow_redirects=False)
        assert r.status_code == 403 and "set-cookie" not in r.headers
    r = c.post("/login", data={"token": TOKEN}, headers={"Origin": "http://testserver"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("dlshare_token=") and "HttpOnly" in cookie and "SameSite=strict" in cookie \
        and "Path=/" in cookie and "Secure" not in cookie  # plain http here; https (or a proxy saying so) adds it
    assert r.headers["referrer-policy"] == "no-referrer"
    page = c.get("/")
    assert page.status_code == 200 and "dlshare scheduler" in page.text and "id='login'" not in page.text
    assert TOKEN not in page.text and "token=" not in page.text  # no link or refresh carries it
    assert "http-equiv='refresh' content='3;url=/?refresh=3&amp;window=1h'" in page.text
    assert c.get("/v1/jobs").status_code == 401  # the cookie is the page's only: the API wants the header
    assert c.get("/metrics").status_code == 401
    c.post("/logout", follow_redirects=False)
    assert c.get("/").status_code == 401
    r = c.post("/login", data={"token": TOKEN}, headers={"X-Forwarded-Proto": "https"}, follow_redirects=False)
    assert "Secure" in r.headers["set-cookie"]


def test_submit_get_list_cancel_events(api):
    c, svc = api
    r = c.post("/v1/jobs", json=GOOD, headers=auth())
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued" and job["spec"]["model"] == "resnet50" and job["id"].startswith("job-")
    assert c.get(f"/v1/jobs/{job['id']}", headers=auth()).json()["id"] == job["id"]
    listed = c.get("/v1/jobs", params={"state": "queued"}, headers=auth()).json()
    assert listed["total"] == 1 and listed["jobs"][0]["id"] == job["id"]
    assert c.get("/v1/jobs", params={"state": "running"}, headers=auth()).json()["total"] == 0
    r = c.delete(f"/v1/jobs/{job['id']}", headers=auth())
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    kinds = [e["kind"] for e in c.get(f"/v1/jobs/{job['id']}/events", headers=auth()).json()["events"]]
    assert kinds == ["submitted", "cancelled"]
    assert c.get("/v1/jobs/nope", headers=auth()).status_code == 404
    assert c.delete("/v1/jobs/nope", headers=auth()).status_code == 404
    assert c.get("/v1/jobs/nope/events", headers=auth()).status_code == 404


def test_resubmitting_an_id_is_idempotent_and_a_clash_is_409(api):
    c, _ = api
    spec = {**GOOD, "id": "train-1"}
    assert c.post("/v1/jobs", json=spec, headers=auth()).status_code == 201
    again = c.post("/v1/jobs", json=spec, headers=auth())
    assert again.status_code == 200 and again.json()["id"] == "train-1"
    clash = c.post("/v1/jobs", json={**spec, "cpus": 3}, headers=auth())
    assert clash.status_code == 409 and "different spec" in clash.json()["detail"]
    assert c.get("/v1/jobs", headers=auth()).json()["total"] == 1


@pytest.mark.parametrize("patch, field, words", [
    ({"cpus": 0}, "cpus", "greater than 0"),
    ({"cpus": -1}, "cpus", "greater than 0"),
    ({"gpus": 1000}, "gpus", "less than or equal"),
    ({"command": []}, "command", "at least 1"),
    ({"command": ["a\x00b"]}, "command", "pattern"),
    ({"memory_byte": 5}, "memory_byte", "Extra inputs"),
    ({"graph_features": {"flops": -1}}, "graph_features.flops", "greater than or equal to 0"),
    ({"graph_features": {"colour": 1}}, "graph_features.colour", "Extra inputs"),
    ({"env": {"1BAD": "x"}}, "env", "pattern"),
    ({"cwd": "relative/dir"}, "cwd", "pattern"),
    ({"priority": 10**9}, "priority", "less than or equal to 1000"),
    ({"memory_bytes": 10}, "memory_bytes", "greater than or equal to 1048576"),
    ({"id": "bad/id"}, "id", "pattern"),
    ({"batch_size": "big"}, "batch_size", "integer"),
    ({"remote_memory_bytes": -1}, "remote_memory_bytes", "greater than or equal to 0"),
    ({"remote_memory_bytes": 1 << 60}, "remote_memory_bytes", "less than or equal"),
])
def test_invalid_specs_get_a_precise_422_and_reach_nothing(api, patch, field, words):
    c, svc = api
    r = c.post("/v1/jobs", json={**GOOD, **patch}, headers=auth())
    assert r.status_code == 422, r.text
    body = r.json()
    assert any(e["field"].startswith(field) for e in body["detail"]), body
    assert words in body["message"], body["message"]
    assert svc.store.list_jobs()[1] == 0


def test_non_json_body_is_422(api):
    c, svc = api
    r = c.post("/v1/jobs", content=b"{not json", headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["message"]
    assert svc.store.list_jobs()[1] == 0


def test_cluster_view_has_the_parts(api):
    c, svc = api
    view = c.get("/v1/cluster", headers=auth()).json()
    assert set(view) >= {"nodes", "jobs_by_state", "gpus_total", "memory_lent_bytes", "aggregation", "profile"}
    assert view["profile"] == "dlshare"


@pytest.mark.parametrize("params,words", [
    ({"offset": "-1"}, "offset"),
    ({"limit": "0"}, "limit"),
    ({"state": "sleeping"}, "state"),
    ({"nosuch": "1"}, "nosuch"),
])
def test_bad_query_parameters_get_a_precise_422(api, params, words):
    c, _ = api
    r = c.get("/v1/jobs", params=params, headers=auth())
    assert r.status_code == 422, (params, r.status_code, r.text)
    assert words in r.text
