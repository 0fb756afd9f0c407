"""Floor 0: the command framework every ``dlshare`` command module is written against.

A command module defines ``register(cli)`` and receives a :class:`Commands` registry: ``cli.add``
adds a subcommand, ``cli.config_flag`` a flag that sets a config key, so that the precedence
defaults < file < environment < flags holds everywhere.  :func:`main` parses, loads the config,
sets up logging and runs the command.  The console script (:mod:`nodesvc.cli`) finds the modules
through their entry points; a module may also run on its own (``python -m aggregator.cli``) with
``main([register], argv)``.  Nothing here knows any command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nodesvc.bus import config, logs

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


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser whose own arguments may be added late: ``arguments(parser)`` runs the
    first time the subcommand is parsed or its help is shown, never for another command.  So a
    command whose arguments come from heavy modules (the benchmarks, each with its own flags) costs
    nothing to ``dlshare node`` or ``dlshare --help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments: Callable[[argparse.ArgumentParser], None] | None = None

    def _ensure(self) -> None:
        build, self._arguments = self._arguments, None
        if build is not None:
            build(self)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._ensure()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ensure()
        return super().format_help()

    def format_usage(self) -> str:
        self._ensure()
        return super().format_usage()


def add_command(sub, name: str, run: RunFn, help: str, sections: Sequence[str] = (),
                quiet: bool = False,
                arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    """Add subcommand ``name``; ``sections`` are the config sections it prints and uses.  ``quiet``:
    a command whose output is its answer (``job``, ``status``, ``sim``...): library logs below
    warning (httpx's request lines, ...) stay out of it unless ``--log-level`` asks for them.
    ``arguments(parser)``: adds the command's own arguments only when the command is used (see
    :class:`_Subcommand`); a command may instead add them to the returned parser at once."""
    p = sub.add_parser(name, help=help, description=help, parents=[_common()])
    if isinstance(p, _Subcommand):
        p._arguments = arguments
    elif arguments is not None:  # a parser built elsewhere (a test's): add them now
        arguments(p)
    p.set_defaults(_run=run, _sections=[config.GLOBAL, *sections], _quiet=quiet)
    return p


# --- the drain action that daemon commands share (``dlshare agg drain ID``, ``dlshare node drain ID``) ---

def add_drain(parser: argparse.ArgumentParser, action: str, what: str) -> None:
    """``dlshare CMD [ACTION] [ID]``: ``action`` (the default: run the daemon) or ``drain`` a running
    one, named by ``ID`` (``args.target``), with the drain's wait flags."""
    parser.add_argument("action", nargs="?", choices=[action, "drain"], default=action,
                        help=f"{action} (default), or drain a running {what}")
    parser.add_argument("target", nargs="?", metavar="ID", help=f"drain: the {what}'s id")
    parser.add_argument("--no-wait", action="store_true", help="drain: return once the drain has started")
    parser.add_argument("--wait-timeout", type=float, default=600.0, metavar="S",
                        help="drain: give up waiting after S seconds (default 600)")
    parser.add_argument("--reply-timeout", type=float, default=10.0, metavar="S",
                        help=f"drain: a {what} that does not answer within S seconds is an error (default 10)")


def drain_usage_error(args: argparse.Namespace, cmd: str, what: str) -> int | None:
    """For a command with :func:`add_drain`: exit status 2 with a message for a drain without an id or
    an id without ``drain``; None when the arguments are right."""
    if args.action == "drain" and not args.target:
        print(f"dlshare {cmd} drain: name the {what} to drain (its id)", file=sys.stderr)
        return 2
    if args.action != "drain" and args.target:
        print(f"dlshare {cmd}: unexpected argument {args.target!r} (did you mean `dlshare {cmd} drain "
              f"{args.target}`?)", file=sys.stderr)
        return 2
    return None


def print_when_changed() -> Callable[[str], None]:
    """A progress printer for a drain's polls: prints a line only when it differs from the last one."""
    last: list[str] = []

    def show(line: str) -> None:
        if not last or last[-1] != line:
            print(line, flush=True)
            last[:] = [line]

    return show


def check_broker(url: str) -> str:
    """A command's broker URL checked before it starts (its form and the TLS files it names), so that a
    mistake is a config error, not a traceback or a daemon retrying for ever.  Returns the URL without
    user name and password, for messages and logs."""
    from nodesvc.bus.mqtt import parse_broker_url

    try:
        addr = parse_broker_url(url)
        addr.tls_context()
    except ValueError as exc:
        raise config.ConfigError(str(exc)) from None
    return addr.url()


def run_drain(cmd: str, broker: str, coro) -> Any:
    """Run a drain coroutine and return its result; a refusal, no answer, a drain not finished in time
    or an unreachable broker is one line on stderr and exit status 1 (returned as the int 1)."""
    import asyncio

    import aiomqtt

    from nodesvc.bus.rpc import CommandError

    try:
        shown = check_broker(broker)
    except config.ConfigError:
        coro.close()
        raise
    try:
        return asyncio.run(coro)
    except (CommandError, TimeoutError) as exc:
        print(f"dlshare {cmd} drain: {exc}", file=sys.stderr)
    except aiomqtt.MqttError as exc:
        print(f"dlshare {cmd} drain: cannot reach broker {shown}: {exc}", file=sys.stderr)
    return 1


class Commands:
    """What a command module's ``register(cli)`` receives: the one way it adds to ``dlshare``."""

    config_flag = staticmethod(config_flag)
    add_drain = staticmethod(add_drain)

    def __init__(self, sub) -> None:
        self._sub = sub

    def add(self, name: str, run: RunFn, help: str, sections: Sequence[str] = (),
            quiet: bool = False,
            arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
        """See :func:`add_command`."""
        return add_command(self._sub, name, run, help, sections, quiet, arguments)


def _flags(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, value in vars(ns).items():
        if dest.startswith(_FLAG_PREFIX) and value is not None:
            sec, key = dest[len(_FLAG_PREFIX):].split("__", 1)
            out.setdefault(sec, {})[key] = value
    return out


def build_parser(registers: Iterable[Callable[[Commands], None]], prog: str = "dlshare",
                 description: str | None = None, version: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if version:
        parser.add_argument("--version", action="version", version=f"{prog} {version}")
    cli = Commands(parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Subcommand))
    for register in registers:
        register(cli)
    return parser


def main(registers: Iterable[Callable[[Commands], None]] | argparse.ArgumentParser,
         argv: Sequence[str] | None = None) -> int:
    """Run one command line: ``registers`` (or a parser built from them), then ``argv``."""
    parser = registers if isinstance(registers, argparse.ArgumentParser) else build_parser(registers)
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
