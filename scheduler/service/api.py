"""The HTTP API (FastAPI): job launchers' endpoints, the cluster view, the status page
and the Kubernetes extender.

Authentication: every ``/v1`` and ``/k8s`` endpoint, and ``/metrics`` (unless ``metrics_open``),
needs ``Authorization: Bearer <token>``; the token names its user (:mod:`scheduler.service.tokens`).
The status page ``/`` is read-only and needs the token too: a proxy in front may add the header,
or the page asks for the token once (``POST /login``, a form) and keeps it in an HttpOnly,
SameSite=Strict cookie that only the page's own paths read.  No URL ever carries a token: a
``?token=`` is refused, not used.  ``/healthz``, ``/openapi.json`` and ``/docs`` are open: they
reveal no cluster state.

Authorisation: a job belongs to the user whose token submitted it.  A user lists, reads,
follows and cancels only their own jobs (another user's job is answered as absent, 404); an
admin sees and changes all of them, submits for other users and manages tokens
(``/v1/tokens``).  The cluster view (nodes, their load, which job ids run where) is every
user's, as ``squeue`` shows every job by default.  ``/k8s/*`` is for kube-scheduler: admins
only, unless ``k8s_open``.
"""


import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from scheduler.service import k8s, status_page
from scheduler.service.http_checks import BAD_BODY, known_query
from scheduler.service.http_limits import TLS_CLIENT, BodyLimit
from scheduler.service.live import SchedulerService
from nodesvc.bus import jobenv
from scheduler.service.models import (
    ApiCluster, ApiError, ApiHistory, ApiJob, ApiJobEvents, ApiJobList, ApiJobSpec, ApiJobState, ApiNewToken,
    ApiToken, ApiTokenList, ApiTokenRequest, ApiWhoami, TERMINAL_STATES,
)
from scheduler.service.rows import ConflictError, JobRow, Owner, QuotaError
from scheduler.service.tokens import Principal, TokenBook, TokenError

log = logging.getLogger("dlshare.sched.api")

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ApiError, "description": "missing or wrong bearer token"},
}
_NOT_FOUND = {404: {"model": ApiError, "description": "no job with this id (or it is another user's)"}}
_ADMIN = {403: {"model": ApiError, "description": "only an admin's token may do this"}}
_INVALID = {422: {"description": "the request does not validate; `detail` lists each field and rule broken"}}


def _owner(who: Principal, user: str | None, account: str | None) -> Owner:
    """The owner of a submission: the caller's own user and account, or (an admin only) the
    ``user``/``account`` the spec names."""
    if not who.admin:
        if user not in (None, who.user):
            raise HTTPException(403, f"user {who.user} may submit jobs only as {who.user}, not as {user}")
        if account not in (None, who.account):
            raise HTTPException(403, f"user {who.user}'s jobs count to account {who.account or '(none)'}; "
                                     f"a token of account {account} is needed for that account")
        return Owner(who.user, who.account)
    if user is None or user == who.user:
        return Owner(who.user, who.account if account is None else account)
    return Owner(user, account or "")


def _same_path(route: Any, request: Request) -> bool:
    regex = getattr(route, "path_regex", None)
    return bool(regex is not None and regex.match(request.url.path))


JobIdPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                               description="the job's id")]


MAX_BODY_BYTES = 8 << 20  # the largest valid job spec is ~1.6 MB; kube-scheduler's NodeList of ~1000 nodes fits


def _bootstrap_user(service: SchedulerService) -> str:
    if service.default_user:
        return service.default_user
    import getpass

    return getpass.getuser()


def create_app(service: SchedulerService, token: str, k8s_open: bool = False,
               max_body_bytes: int = MAX_BODY_BYTES, tokens: TokenBook | None = None,
               env_allow: list[str] = list(jobenv.DEFAULT_ALLOW),
               env_deny: list[str] = list(jobenv.DEFAULT_DENY), metrics_open: bool = False) -> FastAPI:
    """``token``: the bootstrap (admin) token; ``tokens``: the user tokens (default: those in the
    service's database, the bootstrap token acting as the service's ``default_user``).
    ``max_body_bytes``: larger request bodies get a 413 before they are read or parsed.
    ``k8s_open``: serve ``/k8s/*`` without the token.  kube-scheduler's extender client sends
    no Authorization header, so a cluster either fronts the extender with a proxy that adds it,
    or opens these three read-mostly endpoints and restricts who can reach them (NetworkPolicy).
    ``env_allow``/``env_deny``: the variables a job spec may set (:mod:`nodesvc.bus.jobenv`;
    the nodes check again against their own lists).  ``metrics_open``: serve ``/metrics`` without a
    token (for a scraper on a trusted network; by default Prometheus sends a token from a file)."""
    book = tokens if tokens is not None else TokenBook(service.store, token, _bootstrap_user(service))
    app = FastAPI(
        title="dlshare scheduler",
        version="1",
        description="Job-launcher API, cluster view and Kubernetes scheduler extender of dlshare. "
        "Send `Authorization: Bearer <token>` (the token is in `<db>.token` unless configured).",
    )
    app.router.redirect_slashes = False  # /v1/jobs/ is not /v1/jobs: a 404, never a redirect
    bearer = HTTPBearer(auto_error=False, description="a user's token (or the service's bootstrap token)")

    def check_token(request: Request,
                    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        """The caller (the middleware authenticated it before the body was read)."""
        who = getattr(request.state, "principal", None)
        if who is not None:
            return who
        if creds is None or creds.scheme.lower() != "bearer":  # pragma: no cover - the middleware answered
            raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        res = book.authenticate(creds.credentials)
        if res.principal is None:
            raise HTTPException(401, res.why, headers={"WWW-Authenticate": "Bearer"})
        return res.principal

    Caller = Annotated[Principal, Depends(check_token)]

    def admin_only(who: Caller) -> Principal:
        if not who.admin:
            raise HTTPException(403, f"user {who.user} is not an admin: only an admin's token may do this")
        return who

    def page_caller(request: Request) -> Principal | None:
        """The page's caller: a bearer header (a proxy may add it) or the login cookie."""
        scheme, _, cred = request.headers.get("authorization", "").partition(" ")
        given = cred.strip() if scheme.lower() == "bearer" and cred.strip() else request.cookies.get(status_page.COOKIE)
        if not given:
            return None
        return book.authenticate(given).principal

    def job_view(row: JobRow) -> dict[str, Any]:
        """A job as the API shows it: its row, and for a waiting job why, where and until when."""
        out = row.as_api()
        info = service.pending.info(row.id) if row.state not in TERMINAL_STATES and row.state != "running" else None
        if info is not None:
            out["reason"] = info["reason"]
        out["waiting"] = info
        return out

    def own_job(job_id: str, who: Principal) -> JobRow:
        """The job, when the caller may see it; another user's job is as absent as a missing one."""
        row = service.store.get_job(job_id)
        if row is None or not who.may_see(row.user):
            raise HTTPException(404, f"no job {job_id!r}")
        return row

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            errors.append({"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type"),
                           "field": loc or "(body)"})
        summary = "; ".join(f"{e['field']}: {e['msg']}" for e in errors)
        return JSONResponse({"detail": errors, "message": f"invalid request: {summary}"}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first matching route's methods; list every method of this path.
            allowed: set[str] = set()
            for route in app.router.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                methods = getattr(route, "methods", None) or set()
                if match != Match.NONE and methods and _same_path(route, request):
                    allowed |= methods
            headers["Allow"] = ", ".join(sorted(allowed))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    @app.middleware("http")
    async def _token_first(request: Request, call_next):
        # Checked before the body is read or validated: a caller without the token learns nothing,
        # not even whether its request would have validated.  (The dependency below documents it.)
        path = request.url.path
        client = (request.scope.get("state") or {}).get(TLS_CLIENT)
        if path.startswith("/k8s/") and not k8s_open and client:
            # a client certificate signed by sched.k8s_client_ca_file: kube-scheduler's, for /k8s/* only
            request.state.principal = Principal(user=f"tls:{client}", admin=True)
            return await call_next(request)
        if path.startswith("/v1/") or (path.startswith("/k8s/") and not k8s_open) or (path == "/metrics"
                                                                                          and not metrics_open):
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not cred:
                return JSONResponse({"detail": "missing bearer token: send 'Authorization: Bearer <token>'"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            res = book.authenticate(cred.strip())
            if res.principal is None:
                return JSONResponse({"detail": res.why}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            request.state.principal = res.principal
            if request.url.path.startswith("/k8s/") and not res.principal.admin:
                return JSONResponse({"detail": f"user {res.principal.user} is not an admin: the extender's "
                                               "endpoints are kube-scheduler's (an admin token)"}, status_code=403)
        return await call_next(request)

    auth = [Depends(check_token)]

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=201, response_model=ApiJob, dependencies=[known_query()], tags=["jobs"],
              responses={**_AUTH_RESPONSES, **_INVALID, **BAD_BODY, 200: {"model": ApiJob, "description": "an identical job with this id existed"},
                         403: {"model": ApiError, "description": "a user (not an admin) named another owner or account, "
                                                                 "or an environment variable the service refuses"},
                         409: {"model": ApiError, "description": "a job with this id exists with a different spec, "
                                                                 "or another user's"},
                         429: {"model": ApiError, "description": "the owner has as many jobs waiting as the limit "
                                                                 "(sched.max_waiting_per_user / _per_account)"}})
    async def submit(spec: ApiJobSpec, who: Caller) -> Any:
        body = spec.model_dump(exclude_none=True)
        owner = _owner(who, body.pop("user", None), body.pop("account", None))
        bad = jobenv.refused(body.get("env") or {}, env_allow, env_deny)
        if bad:
            raise HTTPException(403, jobenv.explain(bad, "sched.job_env_allow (and node.job_env_allow)"))
        try:
            row, created = await service.submit_async(body, owner)
        except ConflictError as exc:
            raise HTTPException(409, str(exc)) from None
        except QuotaError as exc:
            raise HTTPException(429, str(exc)) from None
        out = ApiJob.model_validate(job_view(row)).model_dump(mode="json")
        return JSONResponse(out, status_code=201 if created else 200)

    @app.get("/v1/jobs", response_model=ApiJobList, dependencies=[known_query("state", "limit", "offset", "user")],
             tags=["jobs"], responses={**_AUTH_RESPONSES, **_INVALID})
    async def list_jobs(who: Caller,
                        state: Annotated[list[ApiJobState] | None, Query(description="filter by state")] = None,
                        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
                        offset: Annotated[int, Query(ge=0, le=1 << 40)] = 0,
                        user: Annotated[str | None, Query(max_length=32, description="an admin: only this user's jobs "
                                                          "(everyone else sees only their own)")] = None) -> Any:
        if not who.admin:
            user = who.user
        rows, total = service.store.list_jobs(states=state, limit=limit, offset=offset, user=user)
        return {"jobs": [job_view(r) for r in rows], "total": total}

    @app.get("/v1/jobs/{job_id}", response_model=ApiJob, dependencies=[known_query()], tags=["jobs"],
             responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def get_job(job_id: JobIdPath, who: Caller) -> Any:
        return job_view(own_job(job_id, who))

    @app.delete("/v1/jobs/{job_id}", response_model=ApiJob, dependencies=[known_query()], tags=["jobs"],
                responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def cancel_job(job_id: JobIdPath, who: Caller) -> Any:
        own_job(job_id, who)  # the owner never changes, so the check holds for the cancel below
        row = await service.call(service.cancel, job_id, f"cancelled by {who.user}")
        if row is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job_view(row)

    @app.get("/v1/jobs/{job_id}/events", response_model=ApiJobEvents, dependencies=[known_query("after")], tags=["jobs"],
             responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def job_events(job_id: JobIdPath, who: Caller, after: Annotated[int, Query(ge=0, le=1 << 62)] = 0) -> Any:
        own_job(job_id, who)
        return {"job": job_id, "events": service.store.events(job=job_id, after=after)}

    @app.get("/v1/whoami", response_model=ApiWhoami, dependencies=[known_query()], tags=["users"],
             responses={**_AUTH_RESPONSES}, summary="the user, account and rights of the token sent")
    async def whoami(who: Caller) -> Any:
        return {"user": who.user, "account": who.account, "admin": who.admin, "token": who.token_id}

    @app.post("/v1/tokens", status_code=201, response_model=ApiNewToken, dependencies=[known_query()], tags=["users"],
              responses={**_AUTH_RESPONSES, **_ADMIN, **_INVALID, **BAD_BODY},
              summary="a new token for a user (admins only); the token is in this answer only")
    async def create_token(req: ApiTokenRequest, who: Annotated[Principal, Depends(admin_only)]) -> Any:
        try:
            rec, text = book.create(req.user, req.account, req.admin, req.ttl_s, req.note, created_by=who.user)
        except TokenError as exc:
            raise HTTPException(422, str(exc)) from None
        log.info("token %s created for user %s%s by %s", rec.id, rec.user, " (admin)" if rec.admin else "", who.user)
        return JSONResponse({**rec.to_json(book.clock()), "token": text}, status_code=201)

    @app.get("/v1/tokens", response_model=ApiTokenList, dependencies=[known_query()], tags=["users"],
             responses={**_AUTH_RESPONSES}, summary="tokens (an admin: all; a user: their own), never the secrets")
    async def list_tokens(who: Caller) -> Any:
        now = book.clock()
        return {"tokens": [r.to_json(now) for r in book.list(None if who.admin else who.user)]}

    @app.delete("/v1/tokens/{token_id}", response_model=ApiToken, dependencies=[known_query()], tags=["users"],
                responses={**_AUTH_RESPONSES, 404: {"model": ApiError, "description": "no such token (of yours)"}},
                summary="revoke a token (an admin: any; a user: their own); refused from the next request on")
    async def revoke_token(token_id: Annotated[str, Path(pattern=r"^[0-9a-f]{12}$")], who: Caller) -> Any:
        rec = book.get(token_id)
        if rec is None or not who.may_see(rec.user):
            raise HTTPException(404, f"no token {token_id!r}")
        rec = book.revoke(token_id)
        log.info("token %s of user %s revoked by %s", token_id, rec.user, who.user)
        return rec.to_json(book.clock())

    @app.get("/v1/cluster", response_model=ApiCluster, dependencies=[*auth, known_query()], tags=["cluster"],
             responses={**_AUTH_RESPONSES, **_INVALID})
    async def cluster() -> Any:
        return await service.call(service.cluster)

    @app.get("/v1/stats", dependencies=[*auth, known_query()], tags=["cluster"], responses={**_AUTH_RESPONSES},
             summary="the live loop's own figures: telemetry lag, batch times, the last restart and snapshot")
    async def stats() -> Any:
        return await service.call(service.stats_view)

    @app.get("/v1/history", response_model=ApiHistory, dependencies=[*auth, known_query("since", "points")],
             tags=["cluster"], responses={**_AUTH_RESPONSES, **_INVALID},
             summary="the cluster over time: GPUs, CPUs, memory, lent memory, the queue, aggregation load")
    async def history(since: Annotated[float, Query(ge=0, le=1e12, description="only points from this time on "
                                                    "(seconds since the epoch)")] = 0.0,
                      points: Annotated[int, Query(ge=1, le=100_000, description="at most this many points (longer "
                                                   "spans are averaged in buckets)")] = 2000) -> Any:
        return await service.call(service.history_view, since, points)

    @app.get("/metrics", tags=["cluster"], dependencies=[known_query()],
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
                        **_AUTH_RESPONSES},
             summary="Prometheus metrics of the scheduler: the queue by reason, decisions and their latency, JCT")
    async def metrics() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await service.call(service.metrics_view), media_type=CONTENT_TYPE_LATEST)

    def _page_headers() -> dict[str, str]:
        return {"Referrer-Policy": "no-referrer", "Cache-Control": "no-store", "X-Frame-Options": "DENY"}

    @app.get("/", response_class=HTMLResponse, tags=["status"], dependencies=[known_query("refresh", "window", "token")],
             responses={401: {"description": "no token yet: the login form", "content": {"text/html": {}}},
                        400: {"description": "a token in the URL: refused", "content": {"text/html": {}}},
                        422: {"description": "a bad query parameter", "content": {"application/json": {}}}})
    async def status(request: Request,
                     refresh: Annotated[int, Query(ge=1, le=3600, description="seconds between refreshes")] = 3,
                     window: Annotated[str, Query(pattern="^(15m|1h|6h|24h)$",
                                                  description="the charts' span")] = "1h") -> Any:
        if "token" in request.query_params:
            return HTMLResponse(status_page.login_page(
                "A token in a URL ends up in browser history, proxy logs and Referer headers, so it is not "
                "accepted here: enter it below (it is then kept in a cookie)."), status_code=400,
                headers=_page_headers())
        who = page_caller(request)
        if who is None:
            return HTMLResponse(status_page.login_page(), status_code=401, headers=_page_headers())
        mine = None if who.admin else who.user  # a user's page lists their own jobs
        total = service.store.list_jobs(limit=1, user=mine)[1]
        jobs, _ = service.store.list_jobs(limit=200, offset=max(0, total - 200), user=mine)
        view = await service.call(service.cluster)
        span = status_page.WINDOWS[window]
        hist = await service.call(service.history_view, view["ts"] - span, 600)
        return HTMLResponse(status_page.render(view, [job_view(j) for j in jobs], refresh, hist, window, who.user),
                            headers=_page_headers())

    def _same_origin(request: Request) -> bool:
        """A form posted from this page itself: a browser says so in Sec-Fetch-Site (the page's
        no-referrer policy makes its Origin "null"); an older one in Origin; a client that names
        neither (curl, a script) is not a browser another site could drive."""
        site = request.headers.get("sec-fetch-site")
        if site is not None:
            return site in ("same-origin", "none")
        origin = request.headers.get("origin")
        if origin is None:
            return True
        return origin != "null" and origin.split("://", 1)[-1] == request.headers.get("host", "")

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Any:
        import urllib.parse

        if not _same_origin(request):
            return HTMLResponse(status_page.login_page("refused: the form was posted from another site"),
                                status_code=403, headers=_page_headers())
        body = (await request.body())[:8192].decode("utf-8", "replace")
        given = (urllib.parse.parse_qs(body).get("token") or [""])[0].strip()
        res = book.authenticate(given) if given else None
        if res is None or res.principal is None:
            why = res.why if res is not None else "enter a token"
            return HTMLResponse(status_page.login_page(f"not accepted: {why}"), status_code=401,
                                headers=_page_headers())
        resp = RedirectResponse("/", status_code=303, headers=_page_headers())
        https = request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
        # 12 h, then the form again; a revoked or expired token stops working at once (every request
        # authenticates the cookie anew).
        resp.set_cookie(status_page.COOKIE, given, max_age=12 * 3600, path="/", secure=https, httponly=True,
                        samesite="strict")
        log.info("status page: %s logged in", res.principal.user)
        return resp

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Any:
        resp = RedirectResponse("/", status_code=303, headers=_page_headers())
        resp.delete_cookie(status_page.COOKIE, path="/", httponly=True, samesite="strict")
        return resp

    k8s.add_routes(app, service, [] if k8s_open else [Depends(admin_only)])
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before the body is read
    return app
