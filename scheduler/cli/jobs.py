"""``dlshare job submit|list|show|events|cancel|whoami`` and ``dlshare token create|list|revoke``: the
scheduler API's client commands (``scheduler.client`` underneath).  Their settings are the ``[sched]``
section's (``url``, ``ca_file``, ``token``, ``db``), which :mod:`scheduler.cli.service` registers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nodesvc.bus import config


def api_client_url(cfg: dict[str, dict[str, Any]]) -> str:
    if cfg["sched"]["url"]:
        return cfg["sched"]["url"]
    from nodesvc.bus.procs import split_hostport

    host, port = split_hostport(cfg["sched"]["listen"], 7800)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{'https' if cfg['sched']['tls_cert_file'] else 'http'}://{host}:{port}"


def _client(cfg):
    from scheduler.client import SchedulerClient, default_token

    token = cfg["sched"]["token"] or default_token(cfg["sched"]["db"])
    if not token:
        raise config.ConfigError(f"no scheduler token: set DLSHARE_SCHED_TOKEN or --token "
                                 f"(the service stores it in {cfg['sched']['db']}.token)")
    try:
        return SchedulerClient(api_client_url(cfg), token, ca_file=cfg["sched"]["ca_file"] or None)
    except ValueError as exc:  # a CA file that cannot be read
        raise config.ConfigError(str(exc)) from None


MAX_SPEC_BYTES = 16 << 20  # the largest valid spec (256 args and 128 variables of 4 KiB) is ~1.6 MB


def _read_spec(name: str) -> dict[str, Any]:
    """A job spec file (``-``: stdin): one JSON object of finite numbers; any problem is a
    ValueError naming the file."""
    from scheduler.data import read_capped

    where = "stdin" if name == "-" else name
    raw = read_capped(name, MAX_SPEC_BYTES, ValueError, f"job spec {where}")

    def finite(text: str) -> float:
        v = float(text)
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"job spec {where}: {text} is not a finite number")
        return v

    def no_constant(name: str) -> Any:
        raise ValueError(f"job spec {where}: {name} is not JSON")

    try:
        spec = json.loads(raw.decode("utf-8-sig"), parse_float=finite, parse_constant=no_constant)
    except UnicodeDecodeError:
        raise ValueError(f"job spec {where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"job spec {where}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ValueError(f"job spec {where}: nested too deeply") from None
    if not isinstance(spec, dict):
        raise ValueError(f"job spec {where}: must hold a JSON object, not {type(spec).__name__}")
    return spec


def _spec_from_args(args) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if args.spec:
        spec = _read_spec(args.spec)
    for key in ("id", "name", "kind", "model", "batch_size", "gpus", "cpus", "priority", "cwd", "user", "account"):
        v = getattr(args, key.replace("-", "_"), None)
        if v is not None:
            spec[key] = v
    if args.memory is not None:
        spec["memory_bytes"] = _parse_bytes(args.memory)
    if args.env:
        env = dict(spec.get("env") or {})
        for kv in args.env:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ValueError(f"--env {kv!r}: expected NAME=VALUE")
            env[k] = v
        spec["env"] = env
    if args.argv:
        argv = args.argv[1:] if args.argv[0] == "--" else args.argv
        spec["command"] = argv
    return spec


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().rstrip("b").rstrip("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _width() -> int:
    import shutil

    return max(40, shutil.get_terminal_size((80, 24)).columns)


def _resolve(c, ref: str) -> dict[str, Any]:
    """The job ``ref`` names: its id, or a prefix of exactly one of the caller's job ids."""
    from scheduler.client import SchedulerApiError

    try:
        return c.get(ref)
    except SchedulerApiError as exc:
        if exc.status != 404:
            raise
    hits = [j for j in c.all() if j["id"].startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise SchedulerApiError(404, f"no job {ref!r} (nor one whose id starts with it)")
    raise SchedulerApiError(409, f"{ref!r} starts {len(hits)} job ids: "
                                 + ", ".join(h["id"] for h in hits[:8]) + (" ..." if len(hits) > 8 else ""))


def _run_job(args, cfg) -> int:
    import time

    from scheduler.cli.job_output import describe, events_table, job_table
    from scheduler.client import SchedulerApiError

    as_json = args.json_out or getattr(args, "json_sub", False) or getattr(args, "output", None) == "json"
    try:
        with _client(cfg) as c:
            if args.action == "submit":
                job = c.submit(_spec_from_args(args))
                if args.wait:
                    job = c.wait(job["id"], timeout=args.wait)
                print(json.dumps(job, indent=2) if as_json else f"{job['id']} {job['state']}")
                return 0 if job["state"] not in ("failed", "cancelled") else 1
            if args.action == "list":
                jobs = c.list(states=args.state or None, user=args.user)
                if as_json:
                    print(json.dumps(jobs, indent=2))
                elif not jobs:
                    print("no jobs", file=sys.stderr)
                else:
                    print(job_table(jobs, time.time(), _width(), wide=args.output == "wide"))
            elif args.action == "show":
                job = _resolve(c, args.job)
                if as_json:
                    print(json.dumps(job, indent=2))
                else:
                    print(describe(job, c.events(job["id"]), time.time()))
            elif args.action == "events":
                job = _resolve(c, args.job)
                evs = c.events(job["id"])
                if as_json:
                    for e in evs:
                        print(json.dumps(e))
                else:
                    print(events_table(evs, time.time()))
            elif args.action == "cancel":
                job = c.cancel(_resolve(c, args.job)["id"])
                print(f"{job['id']} {job['state']}")
            elif args.action == "whoami":
                me = c.whoami()
                print(json.dumps(me) if as_json else
                      f"{me['user']}{' (admin)' if me['admin'] else ''} account {me['account'] or '-'} "
                      f"token {me['token']}")
    except (SchedulerApiError, ValueError, OSError) as exc:
        return _failed("job", exc)
    return 0


def _failed(command: str, exc: Exception) -> int:
    """Say why ``dlshare COMMAND`` failed; its exit status: 1 when the API refused, 2 for bad input or
    configuration, or a service out of reach."""
    from scheduler.client import SchedulerApiError

    print(f"dlshare {command}: {exc}", file=sys.stderr)
    return 1 if isinstance(exc, SchedulerApiError) else 2


def parse_duration(text: str) -> float:
    """Seconds in ``3600``, ``90m``, ``12h``, ``30d`` or ``2w``; ValueError otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    mult = units.get(t[-1:], None)
    try:
        v = float(t[:-1] if mult else t) * (mult or 1)
    except ValueError:
        raise ValueError(f"duration {text!r}: expected seconds or a number with s, m, h, d or w") from None
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"duration {text!r} must be positive")
    return v


def _run_token(args, cfg) -> int:
    from rich.console import Console
    from rich.table import Table

    from scheduler.client import SchedulerApiError

    try:
        with _client(cfg) as c:
            if args.action == "create":
                ttl = parse_duration(args.expires) if args.expires else float(cfg["sched"]["token_ttl_s"])
                tok = c.create_token(args.user, account=args.account, admin=args.admin, ttl_s=ttl, note=args.note)
                if args.json_out:
                    print(json.dumps(tok, indent=2))
                else:
                    import datetime

                    until = datetime.datetime.fromtimestamp(tok["expires_at"]).isoformat(timespec="seconds")
                    print(tok["token"])
                    print(f"token {tok['id']} for user {tok['user']}{' (admin)' if tok['admin'] else ''}, "
                          f"account {tok['account'] or '-'}, expires {until}: it is shown only now", file=sys.stderr)
            elif args.action == "list":
                toks = c.tokens()
                if args.json_out:
                    print(json.dumps(toks, indent=2))
                else:
                    import datetime

                    table = Table("id", "user", "account", "admin", "state", "expires", "note")
                    for t in toks:
                        table.add_row(t["id"], t["user"], t["account"] or "-", "yes" if t["admin"] else "",
                                      t["state"], datetime.datetime.fromtimestamp(t["expires_at"]).isoformat(
                                          timespec="minutes"), t["note"])
                    Console().print(table)
            elif args.action == "revoke":
                t = c.revoke_token(args.id)
                print(f"{t['id']} {t['state']} (user {t['user']})")
    except (SchedulerApiError, ValueError, OSError) as exc:
        return _failed("token", exc)
    return 0


def _api_client_flags(cli, p, token_help: str) -> None:
    """The flags of a command that talks to the scheduler API: where it is, whose token, and JSON out."""
    cli.config_flag(p, "--url", "sched", "url", help="scheduler URL (default http(s)://<sched.listen>)")
    cli.config_flag(p, "--ca-file", "sched", "ca_file", help="CA bundle that signed an https:// API's certificate "
                    "(default: the system's trust store)")
    cli.config_flag(p, "--token", "sched", "token", help=f"{token_help} (default $DLSHARE_SCHED_TOKEN or <db>.token)")
    cli.config_flag(p, "--db", "sched", "db", help="where the service keeps its DB (to find <db>.token)")
    p.add_argument("--json", dest="json_out", action="store_true", help="print JSON")


def register(cli) -> None:
    j = cli.add("job", _run_job, "submit, list, show or cancel jobs through the scheduler API",
                sections=["sched"], quiet=True)
    _api_client_flags(cli, j, "bearer token")
    acts = j.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = acts.add_parser("submit", help="submit a job: dlshare job submit --gpus 1 --model resnet50 -- python train.py")
    s.add_argument("--spec", metavar="FILE", help="JSON job spec (- for stdin); flags override its keys")
    s.add_argument("--id"), s.add_argument("--name"), s.add_argument("--model")
    s.add_argument("--kind", choices=["training", "data_prep", "inference", "other"])
    s.add_argument("--batch-size", dest="batch_size", type=int)
    s.add_argument("--gpus", type=int), s.add_argument("--cpus", type=float)
    s.add_argument("--memory", help="host memory, e.g. 4GiB")
    s.add_argument("--priority", type=int), s.add_argument("--cwd")
    s.add_argument("--user", help="an admin: submit as this user (the job runs as them)")
    s.add_argument("--account", help="the account the job counts to (default: your token's)")
    s.add_argument("--env", action="append", metavar="NAME=VALUE")
    s.add_argument("--wait", type=float, metavar="SECONDS", help="wait until the job ends")
    s.add_argument("argv", nargs=argparse.REMAINDER, help="the command to run")
    ls = acts.add_parser("list", help="list jobs (yours; an admin's token: everyone's), fitted to the terminal")
    ls.add_argument("--state", action="append", choices=["queued", "running", "preempted", "done", "failed", "cancelled"])
    ls.add_argument("--user", help="an admin: only this user's jobs")
    ls.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: every column, nothing cut (owner, CPUs, memory, queue position, estimated start); "
                         "json: the API's objects")
    for name, what in (("show", "one job: why it waits, where it stands, when it should start, its events"),
                       ("events", "one job's events"), ("cancel", "cancel one job")):
        a = acts.add_parser(name, help=what)
        a.add_argument("job", help="the job's id, or a prefix of exactly one of your job ids")
        if name != "cancel":
            a.add_argument("--json", dest="json_sub", action="store_true", help="print JSON")
    acts.add_parser("whoami", help="the user, account and rights of your token")

    t = cli.add("token", _run_token, "create, list or revoke users' API tokens (an admin's token)",
                sections=["sched"], quiet=True)
    _api_client_flags(cli, t, "an admin's token")
    tacts = t.add_subparsers(dest="action", metavar="ACTION", required=True)
    tc = tacts.add_parser("create", help="a new token for a user: dlshare token create alice --account vision")
    tc.add_argument("user", help="the user it acts as: its jobs run as this user on the nodes")
    tc.add_argument("--account", default="", help="the account its jobs count to")
    tc.add_argument("--admin", action="store_true", help="an admin token: every job, and tokens")
    tc.add_argument("--expires", metavar="DURATION", help="lifetime: 3600, 90m, 12h, 30d (default sched.token_ttl_s)")
    tc.add_argument("--note", default="", help="a note shown in listings")
    tacts.add_parser("list", help="list tokens (never their secrets)")
    tr = tacts.add_parser("revoke", help="revoke a token by its id (refused from the next request on)")
    tr.add_argument("id")



__all__ = ["api_client_url", "register"]
