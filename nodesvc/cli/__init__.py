"""Floor 3, the top: the one console script, ``dlshare``.

Each package contributes its subcommands from its own module, which defines
``register(sub)`` and calls :func:`add_command` for each command.  A command's
flags that set config keys are declared with :func:`config_flag`, so the
precedence defaults < file < environment < flags holds everywhere.

- :mod:`~nodesvc.cli.node`: ``dlshare node`` (runs :mod:`nodesvc.daemon`);
- :mod:`~nodesvc.cli.broker`: ``dlshare broker`` (the embedded amqtt broker);
- :mod:`~nodesvc.cli.status`: ``dlshare status`` (the cluster from retained state);
- :mod:`~nodesvc.cli.up` and :mod:`~nodesvc.cli.tour`: ``dlshare up [--tour]``;
- :mod:`~nodesvc.cli.output`: shared console output.

May import: every floor below (:mod:`nodesvc.bus`, the libraries and cores, the shells
:mod:`nodesvc.daemon`, ``aggregator.server``, ``scheduler.service``) and the other packages'
command modules, which it loads by name (:data:`COMMAND_MODULES`; ``bench.cli`` too, so nothing
imports ``bench``).  Nothing below floor 3 may import this package.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from nodesvc import __version__
from nodesvc.bus import config, logs

log = logging.getLogger("dlshare.cli")

# Modules that contribute subcommands.  A module that is not installed (an
# optional part) is skipped; an error inside one that exists is not hidden.
COMMAND_MODULES = [
    "nodesvc.cli.node",
    "nodesvc.cli.broker",
    "nodesvc.cli.status",
    "nodesvc.cli.up",
    "aggregator.cli",
    "scheduler.cli.sim",
    "scheduler.cli.service",
    "scheduler.cli.slurm",
    "bench.cli",
]

_FLAG_PREFIX = "cfg__"

RunFn = Callable[[argparse.Namespace, dict[str, dict[str, Any]]], int | None]


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    g.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                   help="TOML config file (also $DLSHARE_CONFIG)")
    g.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                   help="print the effective config as TOML and exit")
    config_flag(g, "--log-json", config.GLOBAL, "log_json", action="store_const", const=True,
                help="structured logs: one JSON object a line")
    config_flag(g, "--log-level", config.GLOBAL, "log_level", choices=["debug", "info", "warning", "error"])
    return p


def config_flag(parser, flag: str, section: str, key: str, **kwargs) -> None:
    """Add a flag whose value, when given, overrides config ``section.key``."""
    kwargs.setdefault("default", None)
    if "action" not in kwargs and "metavar" not in kwargs:
        kwargs["metavar"] = key.upper()
    parser.add_argument(flag, dest=f"{_FLAG_PREFIX}{section}__{key}", **kwargs)


def add_command(sub, name: str, run: RunFn, help: str, sections: Sequence[str] = (),
                quiet: bool = False) -> argparse.ArgumentParser:
    """Add subcommand ``name``; ``sections`` are the config sections it prints and uses.  ``quiet``:
    a command whose output is its answer (``job``, ``status``, ``sim``...): library logs below
    warning (httpx's request lines, ...) stay out of it unless ``--log-level`` asks for them."""
    p = sub.add_parser(name, help=help, description=help, parents=[_common()])
    p.set_defaults(_run=run, _sections=[config.GLOBAL, *sections], _quiet=quiet)
    return p


def _flags(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(ns).items():
        if dest.startswith(_FLAG_PREFIX) and value is not None:
            sec, key = dest[len(_FLAG_PREFIX):].split("__", 1)
            out.setdefault(sec, {})[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlshare",
        description="dlshare: remote memory, shared aggregation and interference-aware scheduling "
        "for deep-learning clusters",
    )
    parser.add_argument("--version", action="version", version=f"dlshare {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMAND_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name is not None and modname.startswith(exc.name):
                continue  # an optional part that is not present
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        cfg = config.load(getattr(args, "config", None), flags=_flags(args))
    except config.ConfigError as exc:
        print(f"dlshare: config error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "print_config", False):
        sys.stdout.write(config.to_toml(cfg, [s for s in args._sections if s in cfg]))
        return 0
    level = cfg[config.GLOBAL]["log_level"]
    if getattr(args, "_quiet", False) and getattr(args, f"{_FLAG_PREFIX}{config.GLOBAL}__log_level", None) is None:
        level = "warning"
    logs.setup(cfg[config.GLOBAL]["log_json"], level)
    try:
        rc = args._run(args, cfg)
    except KeyboardInterrupt:
        return 130
    except config.ConfigError as exc:
        print(f"dlshare: config error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
