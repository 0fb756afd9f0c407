"""Which environment variables a job's launcher may set: one policy for the scheduler's API and
the node daemon (which checks again: a command may come from anyone who may publish to the node).

A variable passes when its name is listed by exact name in ``allow``, or when it matches a glob
of ``allow`` and no glob of ``deny``.  The default allows every name except the ones that change
how programs are loaded or how the C library behaves (glibc drops the same ones for setuid
programs: ``LD_*``, ``GCONV_PATH``, ...) and the shells' start-up files.  A job runs as its owner,
so such a variable could only ever subvert the owner's own processes; refusing it keeps a job's
libraries the ones the site installed, and an operator opts in by name (``"LD_LIBRARY_PATH"`` in
the allow list).  Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

# glibc's "unsecure" variables (sysdeps/generic/unsecvars.h) and the shells' start-up files.
DEFAULT_DENY: tuple[str, ...] = (
    "LD_*", "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH",
    "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR", "BASH_ENV", "ENV",
)
DEFAULT_ALLOW: tuple[str, ...] = ("*",)
_GLOB = set("*?[")


def _is_glob(pattern: str) -> bool:
    return any(c in _GLOB for c in pattern)


def allowed(name: str, allow: Iterable[str] = DEFAULT_ALLOW, deny: Iterable[str] = DEFAULT_DENY) -> bool:
    """Whether a launcher may set variable ``name`` (case-sensitive, as the environment is)."""
    allow = list(allow)
    if name in allow and not _is_glob(name):
        return True
    return (any(fnmatch.fnmatchcase(name, p) for p in allow)
            and not any(fnmatch.fnmatchcase(name, p) for p in deny))


def refused(names: Iterable[str], allow: Iterable[str] = DEFAULT_ALLOW,
            deny: Iterable[str] = DEFAULT_DENY) -> list[str]:
    """The names of ``names`` a launcher may not set, sorted."""
    allow, deny = list(allow), list(deny)
    return sorted(n for n in set(names) if not allowed(n, allow, deny))


def check_patterns(patterns: object, where: str) -> list[str]:
    """A config list of name globs, or ValueError naming ``where``."""
    if not isinstance(patterns, list) or not all(isinstance(p, str) and 0 < len(p) <= 128 for p in patterns):
        raise ValueError(f"{where} must be a list of variable names or globs (1-128 characters each)")
    return list(patterns)


def explain(names: list[str], key: str) -> str:
    """The refusal's message: which variables, and the setting that would allow them."""
    return (f"environment variable{'s' if len(names) > 1 else ''} {', '.join(names)} may not be set by a job "
            f"(they change how programs load or behave; an operator allows one by naming it in {key})")
