"""``dlshare sim`` (and ``dlshare sim predictor``) and ``dlshare data fetch``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _sim(args, cfg) -> int:
    if args.action == "predictor":
        return _predictor(args)
    if args.action == "replay":
        return _replay(args)
    from scheduler import data
    from scheduler.sim import Cluster, simulate, synthetic_trace
    from scheduler.trace import TraceError, load_trace

    try:
        cluster = Cluster.parse(args.cluster)
        if args.synthetic:
            trace = synthetic_trace(args.synthetic, cluster.total_gpus, seed=args.seed)
            name = f"synthetic-{args.synthetic}"
        else:
            path = data.resolve_trace(args.trace)
            trace = load_trace(path)
            name = path.stem
    except (TraceError, ValueError, FileNotFoundError) as exc:
        print(f"dlshare sim: {exc}", file=sys.stderr)
        return 2
    results = []
    for prof in args.profile.split(","):
        try:
            r = simulate(trace, cluster, prof, seed=args.seed, progress=sys.stderr.isatty(), trace_name=name,
                         restart_overhead_s=args.restart_overhead)
        except ValueError as exc:
            print(f"dlshare sim: {exc}", file=sys.stderr)
            return 2
        results.append(r.metrics())
    from nodesvc.bus.text import markdown_table

    print(markdown_table(results, ["trace", "cluster", "policy", "avg_jct_h", "median_jct_h", "p99_jct_h",
                                   "p99_slowdown", "worst_slowdown", "makespan_h", "avg_queueing_h", "gpu_util", "cpu_util", "mem_util",
                                   "preemptions", "preemptions_per_job", "sim_wall_s"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": results}, indent=2) + "\n")
    return 0


def _predictor(args) -> int:
    """Train on --train, test on --test, print MAPE and MAE.  The header decides the format:
    Lucid co-location rows (``model1 ... speed2``, joined with solo profiles from --solo, by
    default lucid/solo.csv in the data directory) or IADeep utilisation sets
    (``..._sm, ..._mem, sum_interference``)."""
    if not args.train or not args.test:
        print("dlshare sim predictor: --train CSV and --test CSV are required", file=sys.stderr)
        return 2
    try:
        kinds = {_format(args.train), _format(args.test)}
        if len(kinds) != 1:
            raise ValueError("--train and --test are in different formats")
        res = _lucid(args) if kinds == {"lucid"} else _iadeep(args)
    except (OSError, ValueError) as exc:
        print(f"dlshare sim predictor: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _format(path: str) -> str:
    with open(path, newline="") as f:
        header = f.readline().strip().split(",")
    if {"model1", "model2", "speed1", "speed2"} <= set(header):
        return "lucid"
    if "sum_interference" in header:
        return "iadeep"
    raise ValueError(f"{path}: neither Lucid co-location rows (model1..speed2) nor IADeep sets (sum_interference)")


def _lucid(args) -> dict:
    import numpy as np

    from scheduler.predictors.colocation import CoLocationPredictor, lucid_pairs, mape, plain_features

    p1, s1, g1 = lucid_pairs(args.train, args.solo)
    p2, s2, g2 = lucid_pairs(args.test, args.solo)
    model = CoLocationPredictor(seed=args.seed).fit(p1, s1)
    pred = model.predict(p2).ravel()
    y = np.asarray(s2, dtype=float).ravel()
    from sklearn.ensemble import RandomForestRegressor

    sides = [(a, b) for a, b in p1] + [(b, a) for a, b in p1]
    ytr = np.concatenate([np.asarray(s1)[:, 0], np.asarray(s1)[:, 1]])
    forest = RandomForestRegressor(n_estimators=100, random_state=args.seed, n_jobs=1)
    forest.fit(np.asarray([plain_features(a, b) for a, b in sides]), ytr)
    fp = np.stack([forest.predict(np.asarray([plain_features(a, b) for a, b in p2])),
                   forest.predict(np.asarray([plain_features(b, a) for a, b in p2]))], axis=1).ravel()
    const = np.full_like(y, float(np.median(ytr)))
    return {"format": "lucid", "train_rows": len(p1), "test_rows": len(p2),
            "test_pairs": len(set(g2)), "test_pairs_seen_in_training": len(set(g2) & set(g1)),
            "mape": mape(y, pred), "mae": float(np.mean(np.abs(pred - y))),
            "forest_mape": mape(y, fp), "constant_mape": mape(y, const)}


def _iadeep(args) -> dict:
    import numpy as np

    from scheduler import data
    from scheduler.predictors.interference import InterferencePredictor, mape, rows_to_sets

    m1, x1, y1 = data.colocation_util(args.train)
    m2, x2, y2 = data.colocation_util(args.test)
    p = InterferencePredictor(seed=args.seed).fit(rows_to_sets(m1, x1), y1)
    pred = p.predict(rows_to_sets(m2, x2))
    return {"format": "iadeep", "train_rows": len(y1), "test_rows": len(y2), "mape": mape(y2, pred),
            "mae": float(np.mean(np.abs(pred - y2)))}


def _replay(args) -> int:
    """``dlshare sim replay --db PATH``: a live service's logged run, replayed through the core the
    simulator drives, must give the decisions the service recorded."""
    import json as _json

    from scheduler import Predictors, SchedulerState, WatchRules, load_profile
    from scheduler.service.journal import Journal, replay_check
    from scheduler.service.store import JobStore

    if not args.db or not Path(args.db).exists():
        print(f"dlshare sim replay: --db must name a scheduler service database (got {args.db!r})", file=sys.stderr)
        return 2
    store = JobStore(args.db, synchronous="NORMAL")
    try:
        journal = Journal(store)
        profile = args.profile if args.profile != "dlshare" or not journal.meta("profile") else journal.meta("profile")
        rules = WatchRules(**_json.loads(journal.meta("rules") or "{}"))

        def fresh() -> SchedulerState:
            preds = Predictors.from_data() if args.predictors == "data" else Predictors.default()
            return SchedulerState(load_profile(profile), predictors=preds, rules=rules)

        res = replay_check(journal, fresh)
    except (ValueError, OSError) as exc:
        print(f"dlshare sim replay: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()
    print(f"replayed {res.batches} batches ({res.events} events) from {res.start}: "
          + ("the same decisions" if not res.differences else f"{len(res.differences)} batches differ"))
    for line in res.unreadable + res.differences:
        print(f"  {line}")
    return 0 if not res.differences and not res.unreadable else 1


def _data(args, cfg) -> int:
    from scheduler import data, fetch

    dest = Path(args.dest) if args.dest else data.cache_dir()
    try:
        fetch.fetch(dest)
    except OSError as exc:
        print(f"dlshare data fetch: download failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _overhead_s(text: str) -> float:
    """--restart-overhead: finite seconds, at most a day."""
    import argparse
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and 0 <= v <= 86400):
        raise argparse.ArgumentTypeError(f"must be between 0 and 86400 seconds, got {text}")
    return v


def register(cli) -> None:
    from scheduler.sim import RESTART_COST_S

    p = cli.add("sim", _sim, "trace-driven scheduler simulation (or: sim predictor --train --test; "
                "sim replay --db)", quiet=True)
    p.add_argument("action", nargs="?", choices=["run", "predictor", "replay"], default="run")
    p.add_argument("--trace", default="vc_0e4a51", help="trace CSV path or name (vc_0e4a51, vc_103959, static_100job)")
    p.add_argument("--synthetic", type=int, default=0, metavar="N", help="a synthetic trace of N jobs instead")
    p.add_argument("--cluster", default="16x4", help="NODESxGPUS[:CORES:MEMGB][@TYPE], comma-separated groups "
                   "(e.g. 6x4@v100,6x4@p100,6x4@k80: GPU generations, with each job's speed there from Gavel's "
                   "throughputs)")
    p.add_argument("--profile", default="dlshare", help="profile name(s), comma-separated, or a TOML path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-overhead", "--restart-cost", dest="restart_overhead", type=_overhead_s,
                   default=RESTART_COST_S, metavar="S",
                   help=f"GPU seconds each resume of a preempted job costs it (default {RESTART_COST_S:g})")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--train", metavar="CSV", help="predictor: training rows (Lucid colocation.csv or IADeep "
                   "colocation_util.csv format)")
    p.add_argument("--test", metavar="CSV", help="predictor: test rows, same format")
    p.add_argument("--solo", metavar="CSV", help="predictor: Lucid solo profiles (default: lucid/solo.csv in the "
                   "data directory)")
    p.add_argument("--db", metavar="PATH", help="replay: the scheduler service's database")
    p.add_argument("--predictors", choices=["default", "data"], default="default",
                   help="replay without a snapshot: the predictors the service started with (sched.predictors)")
    d = cli.add("data", _data, "shared data files for the scheduler", quiet=True)
    d.add_argument("action", choices=["fetch"])
    d.add_argument("--dest", metavar="DIR", help="where to write (default: the user cache)")
