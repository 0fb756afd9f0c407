"""The project's Python sources, parsed once per test run (several layout tests walk every file)."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nodesvc", "rdma", "aggregator", "scheduler", "bench")


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in (packages or PACKAGES) for p in (ROOT / pkg).rglob("*.py"))
