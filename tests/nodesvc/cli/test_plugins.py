"""Commands as plugins: ``dlshare``'s subcommands come from entry points, and no module names another
package's module in a string (the import graph, and lint-imports, see every arrow)."""

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import nodesvc.cli
from nodesvc.bus import commands
from tests.conftest import ROOT
from tests.source_tree import parsed, sources

PACKAGES = ["nodesvc", "rdma", "aggregator", "scheduler", "bench"]


def _imports_by_name(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, call)`` for each import of a module named by a value: ``importlib.import_module(...)``,
    ``import_module(...)``, ``__import__(...)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_imports_by_name():
    src = "import importlib\nm = importlib.import_module('scheduler.cli.tour')\nx = __import__('bench')\n" \
          "from importlib import import_module\ny = import_module(name)\nimport scheduler\n"
    assert [line for line, _ in _imports_by_name(ast.parse(src))] == [2, 3, 5]


def test_no_project_module_imports_a_module_by_name():
    hits = []
    for path in sources(*PACKAGES):
        hits += [f"{path.relative_to(ROOT)}:{line}: {call}" for line, call in _imports_by_name(parsed(path))]
    assert not hits, "modules imported by name (use a plain import, or an entry point):\n" + "\n".join(hits)


def _declared(group: str) -> dict[str, str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return doc["project"]["entry-points"][group]


@pytest.mark.parametrize("group", [nodesvc.cli.COMMANDS_GROUP, nodesvc.cli.TOUR_GROUP])
def test_the_installed_entry_points_are_the_ones_pyproject_declares(group):
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=group)}
    assert installed == _declared(group), (
        f"the installed package's {group!r} entry points differ from pyproject.toml's: reinstall it "
        "(`make deps`, or `pip install -e .`)")


def test_every_command_module_registers_through_the_registry_it_is_given():
    seen = []

    class Recording(commands.Commands):
        def add(self, name, run, help, sections=(), quiet=False, arguments=None):
            seen.append(name)
            return super().add(name, run, help, sections, quiet, arguments)

    import argparse

    cli = Recording(argparse.ArgumentParser().add_subparsers())
    for _name, register in nodesvc.cli.load_entry_points(nodesvc.cli.COMMANDS_GROUP):
        register(cli)
    assert {"node", "broker", "status", "up", "agg", "sim", "sched", "job", "token", "slurm", "bench"} <= set(seen)
    assert len(seen) == len(set(seen)), f"a command registered twice: {seen}"


def test_a_plugin_needs_nothing_but_the_registry(tmp_path, capsys):
    """A command module written against ``nodesvc.bus.commands`` alone: its flags set config keys, and
    ``commands.main`` runs it (as ``python -m aggregator.cli`` does)."""
    ran = {}

    def register(cli):
        p = cli.add("hello", lambda args, cfg: ran.update(level=cfg["dlshare"]["log_level"], who=args.who) or 3,
                    "say hello")
        p.add_argument("--who", default="world")

    assert commands.main([register], ["hello", "--who", "you", "--log-level", "error"]) == 3
    assert ran == {"level": "error", "who": "you"}
    assert commands.main([register], []) == 2  # no command: help, exit 2
    assert "hello" in capsys.readouterr().out


def _entry_points(*eps):
    return lambda group=None: [ep for ep in eps if ep.group == group]


def test_a_plugin_whose_module_is_absent_is_skipped_and_a_broken_one_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "broken_cmds.py").write_text("import no_such_dependency_here\n\ndef register(cli):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    good = metadata.EntryPoint("node", "nodesvc.cli.node:register", nodesvc.cli.COMMANDS_GROUP)
    absent = metadata.EntryPoint("gone", "no_such_part.cli:register", nodesvc.cli.COMMANDS_GROUP)
    monkeypatch.setattr(nodesvc.cli.metadata, "entry_points", _entry_points(good, absent))
    assert [name for name, _ in nodesvc.cli.load_entry_points(nodesvc.cli.COMMANDS_GROUP)] == ["node"]

    broken = metadata.EntryPoint("broken", "broken_cmds:register", nodesvc.cli.COMMANDS_GROUP)
    monkeypatch.setattr(nodesvc.cli.metadata, "entry_points", _entry_points(good, broken))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        nodesvc.cli.load_entry_points(nodesvc.cli.COMMANDS_GROUP)
    sys.modules.pop("broken_cmds", None)


def test_with_no_command_registered_dlshare_says_to_install_the_package(monkeypatch, capsys):
    monkeypatch.setattr(nodesvc.cli.metadata, "entry_points", _entry_points())
    assert nodesvc.cli.main(["status"]) == 2
    assert "pip install -e ." in capsys.readouterr().err


def test_no_package_names_the_cli_package_in_its_imports():
    """lint-imports forbids it (make test runs it); this says so in the suite too, file by file."""
    bad = []
    for path in sources("rdma", "aggregator", "scheduler", "bench"):
        for node in ast.walk(parsed(path)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for m in mods
                    if m == "nodesvc.cli" or m.startswith("nodesvc.cli.")]
    assert not bad, bad


def test_the_tour_parts_are_entry_points_too():
    parts = dict(nodesvc.cli.load_entry_points(nodesvc.cli.TOUR_GROUP))
    assert "sched" in parts and callable(parts["sched"])
    assert Path(sys.modules[parts["sched"].__module__].__file__).is_relative_to(ROOT)


# Modules no command may load before it is chosen: the benchmarks, the aggregation client and server,
# the embedded broker and torch.  Each costs every other command its start-up time.  (numpy comes with
# the scheduler's core, which the scheduler's commands register with.)
HEAVY = ("bench.agg", "bench.paging", "bench.sched", "aggregator.client", "aggregator.server", "amqtt", "torch")


def _loaded_after(code: str) -> list[str]:
    import subprocess

    probe = code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_building_the_cli_and_its_help_load_no_heavy_module():
    loaded = _loaded_after("import nodesvc.cli, contextlib, io\np = nodesvc.cli.build_parser()\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n"
                           "    try:\n        p.parse_args(['--help'])\n    except SystemExit:\n        pass")
    assert not [m for m in loaded if m in HEAVY], [m for m in loaded if m in HEAVY]


def test_a_commands_own_arguments_load_when_it_is_chosen():
    loaded = _loaded_after("import nodesvc.cli\np = nodesvc.cli.build_parser()\n"
                           "a = p.parse_args(['bench', 'agg', '--quick', '--agg-jobs', '3'])\n"
                           "assert (a.bench, a.quick, a.agg_jobs) == ('agg', True, 3), a")
    assert "bench.agg" in loaded  # the benchmarks' own flags came with it


def test_dlshare_bench_help_lists_every_benchmark_and_their_flags(capsys):
    import bench.cli

    parser = nodesvc.cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    names = set(bench.cli.benches())
    assert names and all(name in out for name in names) and "--agg-jobs" in out and "--working-set" in out
    assert all(nodesvc.cli.build_parser().parse_args(["bench", n]).bench == n for n in [*names, "all"])
    with pytest.raises(SystemExit):
        nodesvc.cli.build_parser().parse_args(["bench", "nosuch"])
