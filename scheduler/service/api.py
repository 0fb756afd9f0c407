"""The HTTP API (FastAPI): job launchers' endpoints, the cluster view, the status page
and the Kubernetes extender.

Authentication: every ``/v1`` and ``/k8s`` endpoint needs ``Authorization: Bearer
<token>``.  The status page ``/`` and its data ``/status.json`` are read-only and
need the token too, given either as the header or once as ``/?token=...`` (the
page then keeps it in the URL of its own refreshes).  ``/healthz``,
``/openapi.json`` and ``/docs`` are open: they reveal no cluster state.
"""


import hmac
import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from scheduler.service import k8s, status_page
from scheduler.service.http_checks import BAD_BODY, known_query
from scheduler.service.http_limits import BodyLimit
from scheduler.service.live import SchedulerService
from scheduler.service.models import ApiCluster, ApiError, ApiJob, ApiJobEvents, ApiJobList, ApiJobSpec, ApiJobState
from scheduler.service.store import ConflictError

log = logging.getLogger("dlshare.sched.api")

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ApiError, "description": "missing or wrong bearer token"},
}
_NOT_FOUND = {404: {"model": ApiError, "description": "no job with this id"}}
_INVALID = {422: {"description": "the request does not validate; `detail` lists each field and rule broken"}}


def _same_path(route: Any, request: Request) -> bool:
    regex = getattr(route, "path_regex", None)
    return bool(regex is not None and regex.match(request.url.path))


JobIdPath = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                               description="the job's id")]


MAX_BODY_BYTES = 8 << 20  # the largest valid job spec is ~1.6 MB; kube-scheduler's NodeList of ~1000 nodes fits


def create_app(service: SchedulerService, token: str, k8s_open: bool = False,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """``max_body_bytes``: larger request bodies get a 413 before they are read or parsed.
    ``k8s_open``: serve ``/k8s/*`` without the token.  kube-scheduler's extender client sends
    no Authorization header, so a cluster either fronts the extender with a proxy that adds it,
    or opens these three read-mostly endpoints and restricts who can reach them (NetworkPolicy)."""
    app = FastAPI(
        title="dlshare scheduler",
        version="1",
        description="Job-launcher API, cluster view and Kubernetes scheduler extender of dlshare. "
        "Send `Authorization: Bearer <token>` (the token is in `<db>.token` unless configured).",
    )
    app.router.redirect_slashes = False  # /v1/jobs/ is not /v1/jobs: a 404, never a redirect
    bearer = HTTPBearer(auto_error=False, description="the service token")

    def check_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if creds is None or creds.scheme.lower() != "bearer":
            raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def check_page_token(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
                         tok: Annotated[str | None, Query(alias="token", description="the service token")] = None
                         ) -> str | None:
        given = tok if tok is not None else (creds.credentials if creds is not None else None)
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            return None
        return given

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
        if request.url.path.startswith("/v1/") or (request.url.path.startswith("/k8s/") and not k8s_open):
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not cred:
                return JSONResponse({"detail": "missing bearer token: send 'Authorization: Bearer <token>'"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(cred.strip().encode(), token.encode()):
                return JSONResponse({"detail": "wrong bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    auth = [Depends(check_token)]

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=201, response_model=ApiJob, dependencies=[*auth, known_query()], tags=["jobs"],
              responses={**_AUTH_RESPONSES, **_INVALID, **BAD_BODY, 200: {"model": ApiJob, "description": "an identical job with this id existed"},
                         409: {"model": ApiError, "description": "a job with this id exists with a different spec"}})
    async def submit(spec: ApiJobSpec) -> Any:
        try:
            row, created = await service.submit_async(spec.model_dump(exclude_none=True))
        except ConflictError as exc:
            raise HTTPException(409, str(exc)) from None
        body = ApiJob.model_validate(row.as_api()).model_dump(mode="json")
        return JSONResponse(body, status_code=201 if created else 200)

    @app.get("/v1/jobs", response_model=ApiJobList, dependencies=[*auth, known_query("state", "limit", "offset")], tags=["jobs"],
             responses={**_AUTH_RESPONSES, **_INVALID})
    async def list_jobs(state: Annotated[list[ApiJobState] | None, Query(description="filter by state")] = None,
                        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
                        offset: Annotated[int, Query(ge=0, le=1 << 40)] = 0) -> Any:
        rows, total = service.store.list_jobs(states=state, limit=limit, offset=offset)
        return {"jobs": [r.as_api() for r in rows], "total": total}

    @app.get("/v1/jobs/{job_id}", response_model=ApiJob, dependencies=[*auth, known_query()], tags=["jobs"],
             responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def get_job(job_id: JobIdPath) -> Any:
        row = service.store.get_job(job_id)
        if row is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return row.as_api()

    @app.delete("/v1/jobs/{job_id}", response_model=ApiJob, dependencies=[*auth, known_query()], tags=["jobs"],
                responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def cancel_job(job_id: JobIdPath) -> Any:
        row = await service.call(service.cancel, job_id)
        if row is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return row.as_api()

    @app.get("/v1/jobs/{job_id}/events", response_model=ApiJobEvents, dependencies=[*auth, known_query("after")], tags=["jobs"],
             responses={**_AUTH_RESPONSES, **_NOT_FOUND, **_INVALID})
    async def job_events(job_id: JobIdPath, after: Annotated[int, Query(ge=0, le=1 << 62)] = 0) -> Any:
        if service.store.get_job(job_id) is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return {"job": job_id, "events": service.store.events(job=job_id, after=after)}

    @app.get("/v1/cluster", response_model=ApiCluster, dependencies=[*auth, known_query()], tags=["cluster"],
             responses={**_AUTH_RESPONSES, **_INVALID})
    async def cluster() -> Any:
        return await service.call(service.cluster)

    @app.get("/v1/stats", dependencies=[*auth, known_query()], tags=["cluster"], responses={**_AUTH_RESPONSES},
             summary="the live loop's own figures: telemetry lag, batch times, the last restart and snapshot")
    async def stats() -> Any:
        return await service.call(service.stats_view)

    @app.get("/", response_class=HTMLResponse, tags=["status"], dependencies=[known_query("token", "refresh")],
             responses={401: {"description": "missing or wrong token (an HTML page that says so)",
                              "content": {"text/html": {}}},
                        422: {"description": "a bad query parameter", "content": {"application/json": {}}}})
    async def status(tok: Annotated[str | None, Depends(check_page_token)],
                     refresh: Annotated[int, Query(ge=1, le=3600, description="seconds between refreshes")] = 3) -> Any:
        if tok is None:
            return HTMLResponse(status_page.DENIED, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        jobs, _ = service.store.list_jobs(limit=200, offset=max(0, service.store.list_jobs(limit=1)[1] - 200))
        view = await service.call(service.cluster)
        return HTMLResponse(status_page.render(view, [j.as_api() for j in jobs], tok, refresh))

    k8s.add_routes(app, service, [] if k8s_open else auth)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before the body is read
    return app
