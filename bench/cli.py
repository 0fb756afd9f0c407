"""``dlshare bench NAME [--quick] [--json PATH]``.

On a terminal each benchmark shows a spinner, its name, its current step (``report.step``) and the
time so far on stderr.

Each benchmark lives in its own module with ``add_arguments(parser)`` and
``run(args) -> dict`` (the JSON envelope of bench/report.py); a module that is
not present yet is simply not offered.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bench import report

BENCHES = {
    "memory": "bench.memory",
    "paging": "bench.paging",
    "cache": "bench.cache",
    "agg": "bench.agg",
    "sched": "bench.sched",
    "sched-service": "bench.sched_service",
    "slurm": "bench.slurm",
    "k8s": "bench.k8s",
    "forecast": "bench.forecast",
}


def _available() -> dict[str, object]:
    mods = {}
    for name, modname in BENCHES.items():
        try:
            mods[name] = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name is None or not modname.startswith(exc.name):
                raise
    return mods


def _run(args, cfg) -> int:
    mods = _available()
    names = list(mods) if args.bench == "all" else [args.bench]
    results = {}
    for i, name in enumerate(names, 1):
        ns = argparse.Namespace(**vars(args))
        if args.bench == "all" and args.json:
            ns.json = str(report.out_dir(args.json) / f"{name}.json")
        with report.step(f"bench {name}" + (f" ({i}/{len(names)})" if len(names) > 1 else "")):
            res = mods[name].run(ns)
        report.write_json(res, ns.json)
        results[name] = res
    if args.bench == "all":
        report.write_json({"bench": "all", "when": report.now_iso(), "results": results}, args.json)
    return 0


def register(sub) -> None:
    from nodesvc.cli import add_command

    mods = _available()
    p = add_command(sub, "bench", _run, "run operator benchmarks against their baselines, side by side", quiet=True)
    p.add_argument("bench", choices=[*mods, "all"], help="which benchmark")
    p.add_argument("--quick", action="store_true", help="small sizes, for a fast check")
    p.add_argument("--json", metavar="PATH", help="write the result JSON here")
    seen: set[str] = set()
    for mod in mods.values():
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p, seen)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
