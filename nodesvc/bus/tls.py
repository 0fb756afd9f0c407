"""TLS contexts from PEM files, for the bus's clients, the embedded broker and the scheduler's HTTP
API and its clients.  A file that cannot be read, is not PEM, or a key that does not match its
certificate raises ValueError naming the file (callers turn it into a config error at start)."""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile


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


class CertFiles:
    """A server's certificate and key on disk, loaded into its live context again when either file
    changes (a renewal by certbot or cert-manager, a Kubernetes Secret volume's symlink swap): new
    handshakes get the new certificate, open connections keep theirs.

    The two files are copied aside and checked together in a scratch context first, so the live
    context is only ever given a pair that loads: a renewal caught between its two writes fails the
    check (``reload_if_changed`` raises ValueError naming the files) and is tried again when the files
    change next.  Call it from the thread that runs the context's handshakes."""

    def __init__(self, ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
        self.ctx, self.cert_file, self.key_file = ctx, cert_file, key_file
        self._seen = self._stamp()

    def _stamp(self) -> tuple:
        out = []
        for path in (self.cert_file, self.key_file):
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def reload_if_changed(self) -> bool:
        """True when the files changed and the context now holds them; False when they did not change."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        with tempfile.TemporaryDirectory(prefix="dlshare-tls-") as tmp:
            cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            try:
                shutil.copyfile(self.cert_file, cert)
                shutil.copyfile(self.key_file, key)
            except OSError as exc:
                raise ValueError(f"TLS certificate {self.cert_file!r} or key {self.key_file!r}: {exc}") from None
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
            except ssl.SSLError as exc:
                raise ValueError(f"TLS certificate {self.cert_file!r} with key {self.key_file!r}: {exc}") from None
            self.ctx.load_cert_chain(cert, key)
        return True
