"""Request checks and documented error responses that every route group of the HTTP API shares
(the launcher API in :mod:`scheduler.service.api`, the extender in :mod:`scheduler.service.k8s`)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError

from scheduler.service.models import ApiError

BAD_BODY: dict[int | str, dict[str, Any]] = {
    400: {"model": ApiError, "description": "the body could not be read as UTF-8 JSON"}}


def known_query(*names: str) -> Any:
    """A dependency that refuses query parameters the operation does not take (a typo such as
    ``?sate=running`` would otherwise be ignored silently)."""

    def check(request: Request) -> None:
        unknown = sorted(set(request.query_params.keys()) - set(names))
        if unknown:
            raise RequestValidationError([{"loc": ("query", k), "msg": f"unknown query parameter {k!r}; this "
                                           f"operation takes {', '.join(names) or 'none'}", "type": "extra_forbidden"}
                                          for k in unknown])

    return Depends(check)
