"""Certificates for the TLS tests, made with the openssl command (Debian's, which `make` installs):
a CA, a second CA that signed nothing the servers use, and a server certificate for 127.0.0.1 (not
for localhost: the tests of a wrong host name use that) signed by the first; a CA for clients, a
client certificate it signed (``client``, CN kube-scheduler) and one the other CA signed (``stranger``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    """``<name>.pem`` and ``<name>.key``: a self-signed CA (P-256, two days)."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def make_signed(d: Path, ca: str, name: str, san: str, cn: str | None = None) -> None:
    """``<name>.pem`` and ``<name>.key``: a certificate for ``san`` (``IP:127.0.0.1``) signed by ``ca``,
    its common name ``cn`` (default ``name``)."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={cn or name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make_test_pki(d: Path) -> Path:
    """``ca``, ``other-ca``, ``server`` (for 127.0.0.1 only, signed by ``ca``), ``client-ca``, ``client``
    (signed by ``client-ca``) and ``stranger`` (a client signed by ``other-ca``) in ``d``."""
    if not shutil.which("openssl"):
        pytest.fail("openssl is missing: run `make deps` (the test command installs it)")
    d.mkdir(parents=True, exist_ok=True)
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_signed(d, "ca", "server", "IP:127.0.0.1")
    make_ca(d, "client-ca")
    make_signed(d, "client-ca", "client", "DNS:kube-scheduler", cn="kube-scheduler")
    make_signed(d, "other-ca", "stranger", "DNS:stranger")
    return d
