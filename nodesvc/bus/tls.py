"""TLS contexts from PEM files, for the bus's clients, the embedded broker and the scheduler's HTTP
API and its clients.  A file that cannot be read, is not PEM, or a key that does not match its
certificate raises ValueError naming the file (callers turn it into a config error at start)."""

from __future__ import annotations

import ssl


def client_context(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None,
                   what: str = "server") -> ssl.SSLContext:
    """A client's context: the server's certificate checked against ``ca_file`` (else the system's
    trust store) and its name against the host; ``cert_file`` (and ``key_file``) a client
    certificate.  ``what`` names the server in errors ("broker", "scheduler")."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{what} CA file {ca_file!r}: {exc}") from None
    if cert_file:
        try:
            ctx.load_cert_chain(cert_file, key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{what} client certificate {cert_file!r}"
                             f"{f' (key {key_file!r})' if key_file else ''}: {exc}") from None
    return ctx


def server_context(cert_file: str, key_file: str, what: str = "TLS certificate") -> ssl.SSLContext:
    """A server's context (TLS 1.2 or later) with ``cert_file`` and ``key_file`` loaded."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{what} {cert_file!r} with key {key_file!r}: {exc}") from None
    return ctx
