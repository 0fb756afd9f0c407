"""Floor 3, the top: the one console script, ``dlshare``.

Commands are plugins.  Each package names its command modules in pyproject.toml's
``[project.entry-points."dlshare.commands"]``; :func:`load_entry_points` reads them with
``importlib.metadata`` (as pytest and flake8 find their plugins) and calls each ``register(cli)``
with a :class:`nodesvc.bus.commands.Commands` registry, which carries all a command module needs: ``cli.add`` for a
subcommand, ``cli.config_flag`` for a flag that sets a config key (so the precedence defaults <
file < environment < flags holds everywhere).  No command module imports this package, and this
package imports none of them by name: the arrows run one way, through the entry points.
The tour's parts (``dlshare up --tour``) are plugins of the same kind (``dlshare.tour``).

- :mod:`~nodesvc.cli.node`: ``dlshare node`` (runs :mod:`nodesvc.daemon`);
- :mod:`~nodesvc.cli.broker`: ``dlshare broker`` (the embedded amqtt broker);
- :mod:`~nodesvc.cli.status`: ``dlshare status`` (the cluster from retained state);
- :mod:`~nodesvc.cli.up` and :mod:`~nodesvc.cli.tour`: ``dlshare up [--tour]``.

May import: every floor below (:mod:`nodesvc.bus`, the libraries and cores, the shells
:mod:`nodesvc.daemon`, ``aggregator.server``, ``scheduler.service``).  Nothing imports this
package (an import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from nodesvc import __version__
from nodesvc.bus import commands

log = logging.getLogger("dlshare.cli")

# The entry-point groups: command modules (``register(cli)``) and the tour's parts
# (``async run_tour(stack, console) -> bool``).
COMMANDS_GROUP = "dlshare.commands"
TOUR_GROUP = "dlshare.tour"


class NotInstalledError(RuntimeError):
    """No command is registered: the package's metadata (its entry points) is not installed."""


def load_entry_points(group: str) -> list[tuple[str, Any]]:
    """``(name, object)`` for each entry point of ``group``, in name order.  One whose module is
    absent (an optional part not installed) is skipped; an error inside one that exists is not
    hidden."""
    out = []
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        modname = ep.value.split(":", 1)[0]
        try:
            out.append((ep.name, ep.load()))
        except ModuleNotFoundError as exc:
            if exc.name is not None and modname.startswith(exc.name):
                continue
            raise
    return out


def build_parser() -> argparse.ArgumentParser:
    plugins = load_entry_points(COMMANDS_GROUP)
    if not plugins:
        raise NotInstalledError(
            f"no dlshare command is registered (entry-point group {COMMANDS_GROUP!r} is empty): install the "
            "package first, e.g. `pip install -e .` in the checkout (make does it)")
    return commands.build_parser(
        [register for _name, register in plugins], prog="dlshare", version=__version__,
        description="dlshare: remote memory, shared aggregation and interference-aware scheduling "
        "for deep-learning clusters")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except NotInstalledError as exc:
        print(f"dlshare: {exc}", file=sys.stderr)
        return 2
    return commands.main(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
