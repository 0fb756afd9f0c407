"""Users of the scheduler API in-process: tokens that belong to users, each user's own jobs, what
an admin may do, expiry and revocation, the admission limit and the environment allow list."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.service.api import create_app
from scheduler.service.live import SchedulerService
from scheduler.service.rows import WaitingLimits
from scheduler.service.tokens import TokenBook
from tests.scheduler.service.svc_helpers import TOKEN, auth

SPEC = {"gpus": 0, "cpus": 1.0, "command": ["python", "train.py"]}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def users(store):
    """(client, service, clock, tokens): alice and bob (account "vision"), carol (account "nlp"), an admin."""
    svc = SchedulerService(store, profile="dlshare", limits=WaitingLimits(per_user=3, per_account=5),
                           default_user="ops")
    clock = Clock()
    book = TokenBook(store, TOKEN, "ops", clock=clock)
    with TestClient(create_app(svc, TOKEN, tokens=book)) as c:
        toks = {}
        for user, account, admin in (("alice", "vision", False), ("bob", "vision", False), ("carol", "nlp", False),
                                     ("dana", "", True)):
            r = c.post("/v1/tokens", json={"user": user, "account": account, "admin": admin}, headers=auth())
            assert r.status_code == 201, r.text
            toks[user] = r.json()["token"]
        yield c, svc, clock, toks


def as_(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


def test_each_user_sees_and_changes_only_their_own_jobs(users):
    """Promise: a job belongs to the user whose token submitted it; another user's job is answered
    as absent (404) to reads, events and cancels, and listings show a user only their own jobs,
    while an admin sees every job and may cancel any."""
    c, svc, _, tok = users
    a = c.post("/v1/jobs", json={**SPEC, "id": "a1"}, headers=as_(tok["alice"])).json()
    b = c.post("/v1/jobs", json={**SPEC, "id": "b1"}, headers=as_(tok["bob"])).json()
    assert (a["user"], a["account"], b["user"], b["account"]) == ("alice", "vision", "bob", "vision")
    assert [j["id"] for j in c.get("/v1/jobs", headers=as_(tok["alice"])).json()["jobs"]] == ["a1"]
    assert [j["id"] for j in c.get("/v1/jobs", params={"user": "bob"}, headers=as_(tok["alice"])).json()["jobs"]] \
        == ["a1"]  # a user's ?user= is ignored: still their own
    for r in (c.get("/v1/jobs/b1", headers=as_(tok["alice"])), c.get("/v1/jobs/b1/events", headers=as_(tok["alice"])),
              c.delete("/v1/jobs/b1", headers=as_(tok["alice"]))):
        assert r.status_code == 404 and r.json()["detail"] == "no job 'b1'", r.text
    assert c.get("/v1/jobs/b1", headers=as_(tok["bob"])).json()["state"] == "queued"  # the cancel changed nothing
    admin = c.get("/v1/jobs", headers=as_(tok["dana"])).json()
    assert [j["id"] for j in admin["jobs"]] == ["a1", "b1"]
    assert [j["id"] for j in c.get("/v1/jobs", params={"user": "bob"}, headers=auth()).json()["jobs"]] == ["b1"]
    r = c.delete("/v1/jobs/b1", headers=as_(tok["dana"]))
    assert r.status_code == 200 and r.json()["state"] == "cancelled" and r.json()["reason"] == "cancelled by dana"
    # The status page lists a user's own jobs only.
    page = c.get("/", headers=as_(tok["alice"])).text
    assert "a1" in page and "b1" not in page


def test_a_job_id_is_one_owners(users):
    """Promise: resubmitting another user's job id (even with the same spec) is a 409, not a view of it."""
    c, _, _, tok = users
    assert c.post("/v1/jobs", json={**SPEC, "id": "shared"}, headers=as_(tok["alice"])).status_code == 201
    r = c.post("/v1/jobs", json={**SPEC, "id": "shared"}, headers=as_(tok["bob"]))
    assert r.status_code == 409 and "taken" in r.json()["detail"] and "alice" not in r.text


def test_only_an_admin_submits_for_another_user(users):
    """Promise: the owner comes from the token; a user naming another user or account gets 403,
    an admin may submit for anyone, and the core's job carries its owner."""
    c, svc, _, tok = users
    r = c.post("/v1/jobs", json={**SPEC, "user": "bob"}, headers=as_(tok["alice"]))
    assert r.status_code == 403 and "only as alice" in r.json()["detail"]
    r = c.post("/v1/jobs", json={**SPEC, "account": "nlp"}, headers=as_(tok["alice"]))
    assert r.status_code == 403 and "account" in r.json()["detail"]
    own = c.post("/v1/jobs", json={**SPEC, "user": "alice", "account": "vision"}, headers=as_(tok["alice"]))
    assert own.status_code == 201 and own.json()["spec"].get("user") is None  # the owner is not in the spec
    r = c.post("/v1/jobs", json={**SPEC, "id": "for-carol", "user": "carol", "account": "nlp"}, headers=auth())
    assert r.status_code == 201 and (r.json()["user"], r.json()["account"]) == ("carol", "nlp")
    assert [j["id"] for j in c.get("/v1/jobs", headers=as_(tok["carol"])).json()["jobs"]] == ["for-carol"]
    boot = c.post("/v1/jobs", json={**SPEC, "id": "mine"}, headers=auth()).json()
    assert boot["user"] == "ops"  # the bootstrap token acts as sched.token_user
    svc.round()
    assert (svc.core.records["for-carol"].job.user, svc.core.records["for-carol"].job.account) == ("carol", "nlp")
    r = c.post("/v1/jobs", json={**SPEC, "user": "not a name"}, headers=auth())
    assert r.status_code == 422


def test_revoked_and_expired_tokens_are_refused_at_once(users):
    """Promise: a revoked token gets 401 on its next request; so does one past its expiry; a user
    may revoke their own tokens but not another's, and only an admin creates tokens."""
    c, _, clock, tok = users
    me = c.get("/v1/whoami", headers=as_(tok["alice"])).json()
    assert me["user"] == "alice" and me["account"] == "vision" and not me["admin"]
    r = c.post("/v1/tokens", json={"user": "alice", "admin": True}, headers=as_(tok["alice"]))
    assert r.status_code == 403
    bob_id = c.get("/v1/whoami", headers=as_(tok["bob"])).json()["token"]
    assert c.delete(f"/v1/tokens/{bob_id}", headers=as_(tok["alice"])).status_code == 404
    listed = c.get("/v1/tokens", headers=as_(tok["alice"])).json()["tokens"]
    assert [t["user"] for t in listed] == ["alice"] and all("token" not in t and "digest" not in t for t in listed)
    assert len(c.get("/v1/tokens", headers=auth()).json()["tokens"]) == 4
    r = c.delete(f"/v1/tokens/{me['token']}", headers=as_(tok["alice"]))
    assert r.status_code == 200 and r.json()["state"] == "revoked"
    r = c.get("/v1/jobs", headers=as_(tok["alice"]))
    assert r.status_code == 401 and r.json()["detail"] == f"token {me['token']} is revoked"
    short = c.post("/v1/tokens", json={"user": "erin", "ttl_s": 60}, headers=auth()).json()
    assert c.get("/v1/jobs", headers=as_(short["token"])).status_code == 200
    clock.t += 61
    r = c.get("/v1/jobs", headers=as_(short["token"]))
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    # A well-formed token with the wrong secret says nothing about the token it names.
    forged = tok["bob"][:-4] + ("AAAA" if not tok["bob"].endswith("AAAA") else "BBBB")
    r = c.get("/v1/jobs", headers=as_(forged))
    assert r.status_code == 401 and r.json()["detail"] == "wrong bearer token"
    assert c.get("/v1/tokens", headers=as_(tok["bob"])).status_code == 200


def test_tokens_are_stored_as_digests_only(users, store):
    """Promise: the database holds a token's SHA-256 digest, never the token or its secret."""
    c, _, _, tok = users
    store.close()  # checkpoint the WAL into the file
    raw = open(store.path, "rb").read()
    for t in tok.values():
        secret = t.split(".", 1)[1]
        assert secret.encode() not in raw and t.encode() not in raw


def test_the_waiting_limit_is_a_429_with_the_reason(users):
    """Promise: a user over sched.max_waiting_per_user (3) gets 429 naming the limit; other users
    still submit; once a job leaves the queue the user may submit again; an account's users share
    its limit (5)."""
    c, _, _, tok = users
    for i in range(3):
        assert c.post("/v1/jobs", json={**SPEC, "id": f"a{i}"}, headers=as_(tok["alice"])).status_code == 201
    r = c.post("/v1/jobs", json={**SPEC, "id": "a3"}, headers=as_(tok["alice"]))
    assert r.status_code == 429 and "max_waiting_per_user" in r.json()["detail"] and "alice" in r.json()["detail"]
    assert c.get("/v1/jobs/a3", headers=as_(tok["alice"])).status_code == 404  # nothing half-stored
    assert c.post("/v1/jobs", json={**SPEC, "id": "c0"}, headers=as_(tok["carol"])).status_code == 201
    c.delete("/v1/jobs/a0", headers=as_(tok["alice"]))
    assert c.post("/v1/jobs", json={**SPEC, "id": "a3"}, headers=as_(tok["alice"])).status_code == 201
    for i in range(2):
        assert c.post("/v1/jobs", json={**SPEC, "id": f"b{i}"}, headers=as_(tok["bob"])).status_code == 201
    r = c.post("/v1/jobs", json={**SPEC, "id": "b2"}, headers=as_(tok["bob"]))
    assert r.status_code == 429 and "account vision" in r.json()["detail"]


def test_loader_variables_are_refused_unless_allowed(store):
    """Promise: a spec that sets LD_PRELOAD (or any variable of the deny list) gets 403 naming it and
    the setting that allows it; an exact name in the allow list lets that one through."""
    svc = SchedulerService(store, profile="dlshare")
    with TestClient(create_app(svc, TOKEN)) as c:
        r = c.post("/v1/jobs", json={**SPEC, "env": {"LD_PRELOAD": "/tmp/x.so", "OK": "1"}}, headers=auth())
        assert r.status_code == 403 and "LD_PRELOAD" in r.json()["detail"] and "job_env_allow" in r.json()["detail"]
        assert "OK" not in r.json()["detail"]
        assert c.get("/v1/jobs", headers=auth()).json()["total"] == 0
    with TestClient(create_app(svc, TOKEN, env_allow=["*", "LD_LIBRARY_PATH"])) as c:
        assert c.post("/v1/jobs", json={**SPEC, "env": {"LD_LIBRARY_PATH": "/opt/x"}}, headers=auth()).status_code == 201
        assert c.post("/v1/jobs", json={**SPEC, "env": {"LD_PRELOAD": "/x"}}, headers=auth()).status_code == 403


def test_the_extender_is_an_admins(users):
    """Promise: /k8s/* (kube-scheduler's) refuses a user's token with 403."""
    c, _, _, tok = users
    r = c.post("/k8s/filter", json={"Pod": {}, "NodeNames": []}, headers=as_(tok["alice"]))
    assert r.status_code == 403 and "admin" in r.json()["detail"]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_any_presented_token_is_a_principal_or_a_reason(text):
    """Fuzz: whatever a caller presents, authentication answers a principal or a reason, never raises."""
    from scheduler.service.store import JobStore

    store = _FUZZ_STORE.setdefault("s", JobStore(":memory:"))
    book = TokenBook(store, TOKEN, "ops")
    res = book.authenticate(text)
    assert (res.principal is None) == (text != TOKEN) and (res.principal is not None or res.why)


_FUZZ_STORE: dict = {}


async def test_run_names_the_owner_and_carries_the_jobs_aggregation_secret(fake_node, live_service):
    """Promise: the scheduler's run names the job's owner (a job without one: the bootstrap user),
    and hands every rank the job's aggregation secret: the same for a job across restarts, another
    for another job, and the spec's own when it brings one."""
    from nodesvc.bus.procs import until
    from scheduler.service.rows import Owner

    n1 = await fake_node("n1", cpus=8, gpus=0)
    svc = await live_service.start(default_user="ops")
    await until(lambda: "n1" in svc.core.nodes, what="n1 registered")
    a, _ = svc.submit(dict(SPEC), Owner("alice", "vision"))
    b, _ = svc.submit(dict(SPEC))
    c, _ = svc.submit({**SPEC, "env": {"DLSHARE_AGG_SECRET": "shared-by-two-jobs"}}, Owner("carol"))
    await until(lambda: {a.id, b.id, c.id} <= set(n1.running), what="the three jobs started")
    run = {x["args"]["job"]: x["args"] for x in n1.ops("run")}
    assert run[a.id]["user"] == "alice" and run[b.id]["user"] == "ops" and run[c.id]["user"] == "carol"
    secrets = {j: run[j]["env"]["DLSHARE_AGG_SECRET"] for j in (a.id, b.id, c.id)}
    assert secrets[c.id] == "shared-by-two-jobs" and secrets[a.id] != secrets[b.id]
    assert len(secrets[a.id]) == 32 and secrets[a.id] == svc.carrier.agg_secret(a.id)
    from scheduler.service.store import JobStore

    again = JobStore(svc.store.path)  # a restarted service reads the same key from its database
    try:
        assert again.service_key("agg") == svc.store.service_key("agg")
    finally:
        again.close()
