"""The plugin catalogue: the built-in plugins, and :func:`build`/:func:`available` for profiles.

Importing this package registers the built-ins (:mod:`~scheduler.plugins.ordering`,
:mod:`~scheduler.plugins.placement`, :mod:`~scheduler.plugins.allocation`) with
:func:`scheduler.framework.register`.  A new built-in module is imported here.
Plugins import :mod:`scheduler.framework`, never the reverse.
"""

from __future__ import annotations

from typing import Any

from scheduler.framework import registered
from scheduler.plugins import allocation, lent, ordering, placement  # noqa: F401  (registers the built-ins)


def build(kind: str, name: str, args: dict[str, Any] | None = None) -> Any:
    """Instantiate plugin ``name`` of ``kind`` with ``args``; a clear error if unknown."""
    known = registered(kind)
    try:
        cls = known[name]
    except KeyError:
        raise ValueError(f"unknown {kind} plugin {name!r} (known: {', '.join(sorted(known))})") from None
    try:
        return cls(**(args or {}))
    except TypeError as exc:
        raise ValueError(f"{kind} plugin {name!r}: bad arguments {args!r}: {exc}") from None


def available(kind: str) -> list[str]:
    """Names of the plugins of ``kind`` a profile may use."""
    return sorted(registered(kind))
