"""Resource ceilings of the HTTP API (the README's Security section): request bodies, request
deadlines and concurrent connections.

- :class:`BodyLimit`, ASGI middleware: a request whose ``Content-Length`` is over the limit gets a
  413 before a byte of its body is read; a body sent without a length (chunked) is counted as the
  app reads it and cut off with a 413 at the limit, so no request makes the service hold more
  than ``max_body_bytes`` of body.  (A 50 MB body used to be parsed, at +100 MB of RSS, before
  its 422.)
- :class:`RequestDeadline`, uvicorn's h11 protocol with a deadline: each request's line, headers
  and body must arrive within ``request_timeout_s`` of its first byte (of the connection's
  opening, for the first request), or the connection is closed.  uvicorn has no such timeout: a
  peer that sends half a request line keeps its socket, and a place under ``limit_concurrency``,
  forever.
- :func:`server_options`: the ``uvicorn.Config`` arguments that apply them, with
  ``limit_concurrency`` (connections and tasks beyond it get 503s) and the keep-alive timeout.

The same protocol tells the app who a TLS client is: a connection whose client certificate the
server verified (HTTPS with ``sched.k8s_client_ca_file``) carries its subject in every request's
``scope["state"][TLS_CLIENT]`` (ASGI's per-request state, copied from the connection's).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TOO_LARGE = b'{"detail":"request body larger than the limit of %d bytes"}'
TLS_CLIENT = "dlshare.tls_client"  # scope["state"] key: the verified client certificate's subject


def cert_subject(cert: dict[str, Any]) -> str:
    """A verified peer certificate's name, as ``ssl`` decodes it: its commonName (else the whole
    subject), for logs and the principal's name."""
    parts = [(k, v) for rdn in cert.get("subject", ()) for k, v in rdn]
    return next((v for k, v in parts if k == "commonName"), None) or ",".join(f"{k}={v}" for k, v in parts) or "?"


class BodyTooLarge(Exception):
    """Raised into the app when a body without Content-Length passes the limit."""


class BodyLimit:
    """ASGI middleware refusing request bodies over ``max_bytes`` with 413 (see the module)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        over = False  # the body passed the limit: whatever the app answers then, the client gets a 413
        started = refused = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise BodyTooLarge()
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal started, refused
            if over and not started:
                if not refused and message["type"] == "http.response.start":
                    refused = True  # FastAPI turns a failed body read into its own 400: answer 413 instead
                    await self._refuse(send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge:
            if started:
                raise
            if not refused:
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        body = _TOO_LARGE % self.max_bytes
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class RequestDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request is not all in within
    ``request_timeout_s`` of its first byte (see the module).  :func:`server_options` makes a
    subclass with the configured timeout."""

    request_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Over TLS this runs after the handshake: a client certificate is here only if it was verified
        # (ssl gives {} when the server asks for none).
        cert = transport.get_extra_info("peercert")
        if cert:
            self.app_state = {**self.app_state, TLS_CLIENT: cert_subject(cert)}
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is all in (or the connection is done)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def server_options(max_connections: int, request_timeout_s: float, keep_alive_s: float) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply the connection ceilings."""
    protocol = type("RequestDeadlineProtocol", (RequestDeadline,), {"request_timeout_s": float(request_timeout_s)})
    return {"http": protocol, "limit_concurrency": int(max_connections), "timeout_keep_alive": float(keep_alive_s)}
