"""``dlshare bench NAME [--quick] [--json PATH]``.

On a terminal each benchmark shows a spinner, its name, its current step (``report.step``) and the
time so far on stderr.

Each benchmark lives in its own module with ``add_arguments(parser)`` and
``run(args) -> dict`` (the JSON envelope of bench/report.py), listed in :func:`benches`.  The
modules are imported only when ``dlshare bench`` runs or shows its help, so that no other command
pays for them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

def benches() -> dict[str, Any]:
    """Each benchmark's module, by the name ``dlshare bench`` takes."""
    from bench import agg, cache, forecast, k8s, memory, paging, paging_bound, sched, sched_service, slurm

    return {"memory": memory, "paging": paging, "paging-bound": paging_bound, "cache": cache, "agg": agg, "sched": sched,
            "sched-service": sched_service, "slurm": slurm, "k8s": k8s, "forecast": forecast}


def _run(args, cfg) -> int:
    from bench import report

    mods = benches()
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


def _arguments(p: argparse.ArgumentParser) -> None:
    mods = benches()
    p.add_argument("bench", choices=[*mods, "all"], help="which benchmark")
    p.add_argument("--quick", action="store_true", help="small sizes, for a fast check")
    p.add_argument("--json", metavar="PATH", help="write the result JSON here")
    seen: set[str] = set()
    for mod in mods.values():
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p, seen)


def register(cli) -> None:
    cli.add("bench", _run, "run operator benchmarks against their baselines, side by side", quiet=True,
            arguments=_arguments)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
