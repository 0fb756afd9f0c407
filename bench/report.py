"""Shared plumbing for benchmarks: machine facts, JSON output, Markdown tables, plots.

Every benchmark returns ``{"bench": NAME, "when": ISO time, "machine": {...},
"metrics": {...}, ...}`` and prints a Markdown table; plots use matplotlib's
Agg backend and go next to the JSON (or into bench/out/).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from nodesvc.bus.text import markdown_table  # noqa: F401  (every bench prints one)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cpuinfo(field: str) -> str:
    """The first CPU's ``field`` in /proc/cpuinfo ("" if absent or unreadable)."""
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip() if ":" in line else ""
    return ""


def idle_settings() -> dict[str, Any]:
    """How this machine's idle CPUs wake.  In a virtual machine a halted vCPU is woken through the
    hypervisor (tens of microseconds); guest halt polling (the cpuidle ``haltpoll`` driver,
    ``guest_halt_poll_ns``: the kernel's default is 200000, 0 turns it off) spins first instead.
    Every hand-off between threads on different vCPUs (a region's fault path has three) pays it."""
    poll = _read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"virtual": "hypervisor" in _cpuinfo("flags").split(), "cpuidle_driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "guest_halt_poll_ns": int(poll) if poll and poll.isascii() and poll.isdigit() else None}


def machine() -> dict[str, Any]:
    freq = psutil.cpu_freq()
    model = _cpuinfo("model name")
    return {
        "host": socket.gethostname(),
        "cpu_model": model,
        "cores": psutil.cpu_count(logical=True),
        "mhz": round(freq.current) if freq else None,
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "idle": idle_settings(),
    }


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def envelope(name: str, metrics: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"bench": name, "when": now_iso(), "machine": machine(), "metrics": metrics, **extra}


def out_dir(json_path: str | None) -> Path:
    d = Path(json_path).parent if json_path else Path("bench/out")
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json(result: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=_default) + "\n")


def _default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(type(o).__name__)


def target_rows(checks: list[tuple[str, float | None, str, float | None]]) -> list[dict[str, Any]]:
    """(name, value, op, bound) -> rows with met/missed, for the target table every bench prints."""
    rows = []
    for name, value, op, bound in checks:
        if value is None or bound is None:
            met = None
        else:
            met = {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[op]
        rows.append({"target": name, "value": value, "op": op, "bound": bound,
                     "met": "n/a" if met is None else ("yes" if met else "MISSED")})
    return rows


def json_events(lines: Iterable[str]) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(event, fields) for each JSON line a workload process prints (``{"event": ..., ...}``); other
    lines (a library's warning on stdout) are skipped."""
    for line in lines:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(msg, dict):
            yield msg.pop("event", None), msg


def print_targets_and_notes(result: dict[str, Any]) -> None:
    """The target table, then each note on a line of its own: how every bench's printout ends."""
    print(markdown_table(result["targets"]))
    for n in result.get("notes", []):
        print(f"note: {n}")


_LIVE: list[Any] = []  # the one rich Progress on screen while steps run (steps nest as its tasks)


@contextmanager
def step(what: str) -> Iterator[Callable[[str], None]]:
    """Progress on a terminal: a spinner, ``what`` and the time so far on stderr while the block
    runs; the function it yields changes the words after ``what`` (``update("12/150 jobs")``).
    Steps nest (each is a line).  Off a terminal (CI, a pipe) it shows nothing."""
    if not sys.stderr.isatty():
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    outer = not _LIVE
    if outer:
        _LIVE.append(Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                              console=Console(stderr=True), transient=True))
        _LIVE[0].start()
    progress = _LIVE[0]
    task = progress.add_task(what, total=None)
    try:
        yield lambda text: progress.update(task, description=f"{what}: {text}")
    finally:
        progress.remove_task(task)
        if outer:
            progress.stop()
            _LIVE.clear()


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
