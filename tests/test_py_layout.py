"""The shape of the Python tree: no circle between files.  lint-imports checks the floors and the
circles between sibling modules of a package; this checks every module against every other, with
the imports inside functions counted too (grimp sees them), so a circle hidden in a lazy import fails.
The check is also run on a synthetic package that it must reject."""

from __future__ import annotations

import sys

import grimp

from tests.c_source import find_circle

PACKAGES = ("nodesvc", "rdma", "aggregator", "scheduler", "bench")


def _graph(*packages: str) -> dict[str, dict[str, list[str]]]:
    g = grimp.build_graph(*packages)
    return {m: {x: [] for x in g.find_modules_directly_imported_by(m) if x in g.modules} for m in g.modules}


def test_no_circle_between_python_files():
    graph = _graph(*PACKAGES)
    assert len(graph) > 150 and "scheduler.service.live" in graph  # the graph is the real tree
    assert "nodesvc.bus.commands" in graph["nodesvc.cli"]
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_check_finds_a_circle_through_a_lazy_import(tmp_path, monkeypatch):
    pkg = tmp_path / "circlepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from circlepkg import b\n\ndef f():\n    return b.g()\n")
    (pkg / "b.py").write_text("def g():\n    from circlepkg import a  # lazy, still an arrow\n    return a\n")
    (pkg / "c.py").write_text("from circlepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        graph = _graph("circlepkg")
        assert find_circle(graph) in (["circlepkg.a", "circlepkg.b", "circlepkg.a"],
                                      ["circlepkg.b", "circlepkg.a", "circlepkg.b"])
    finally:
        for m in [m for m in sys.modules if m.startswith("circlepkg")]:
            del sys.modules[m]
