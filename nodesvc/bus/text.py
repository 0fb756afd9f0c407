"""Text every floor prints: Markdown tables (``dlshare sim``, ``dlshare bench``, the benchmarks).

Pure formatting, kept on the bottom floor so that a command module prints a table without
importing the CLI package (which imports every command module through its entry points)."""

from __future__ import annotations

from typing import Any


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    cols = columns or list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"
