"""deploy/prometheus and deploy/grafana against a real Prometheus (Debian's) and a small live stack.

* ``promtool check rules``, ``promtool check config`` and ``promtool test rules`` (the rules' own
  unit tests, dlshare-rules.test.yml);
* the dashboard JSON is one Grafana can import (unique panel ids, a grid of 24 columns, every
  query on the ``${DS_PROMETHEUS}`` data source);
* a live stack (mosquitto, two real node daemons with simulated GPUs, one of them lending memory,
  an aggregation server and the scheduler service), scraped by a real ``prometheus`` that runs the
  shipped config (its targets, paths and intervals rewritten, its jobs, relabelling and rules as
  shipped): every target is up, every series a rule or a dashboard query selects is scraped
  (``count(<selector>)`` is not empty), every rule evaluates without error, and every dashboard
  query (its Grafana variables filled in) returns data.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from nodesvc.bus.procs import free_port, stop_proc, until, wait_port
from tests.deploy.promql import selectors
from tests.scheduler.service.svc_helpers import TOKEN, SchedProc
from tests.tls_certs import make_test_pki

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dlshare.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RULE_FILES = ("dlshare-rules.yml", "dlshare-alerts.yml")
# Grafana's variables, as a dashboard user with every node selected would send them.
GRAFANA_VARS = {"$node": ".*", "$__rate_interval": "1m", "${DS_PROMETHEUS}": ""}


def _need(tool: str | None, name: str) -> str:
    if tool is None:
        pytest.fail(f"{name} is not installed: `make deps` installs Debian's prometheus package (it has promtool)")
    return tool


def rule_exprs() -> list[tuple[str, str]]:
    """(rule name, expression) of every recording and alerting rule shipped."""
    out = []
    for f in RULE_FILES:
        for group in yaml.safe_load((DEPLOY / f).read_text())["groups"]:
            for r in group["rules"]:
                out.append((r.get("record") or r["alert"], r["expr"]))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables filled in) of every dashboard query."""
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            e = t["expr"]
            for k, v in GRAFANA_VARS.items():
                e = e.replace(k, v)
            out.append((p["title"], e))
    return out


def test_promtool_checks_the_rules_and_runs_their_unit_tests(tmp_path):
    promtool = _need(PROMTOOL, "promtool")
    r = subprocess.run([promtool, "check", "rules", *RULE_FILES], cwd=DEPLOY, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "dlshare-rules.test.yml"], cwd=DEPLOY, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    conf = live_config(tmp_path, nodes=["n1.example:9465"], agg="agg.example:9466", sched="sched.example:7800")
    r = subprocess.run([promtool, "check", "config", str(conf)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_is_one_grafana_imports():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["schemaVersion"] >= 36
    assert {v["name"] for v in d["templating"]["list"]} == {"DS_PROMETHEUS", "node"}
    titles = {p["title"] for p in d["panels"] if p["type"] == "row"}
    assert titles == {"Cluster", "Jobs", "Nodes", "Remote memory", "Aggregation"}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
    assert len(dashboard_exprs()) >= 30


async def until_or(pred, detail, timeout: float, what: str) -> None:
    """``until``, naming what is still wrong (``detail()``) when it times out."""
    try:
        await until(pred, timeout=timeout, what=what, interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; still: {detail()}") from None


def live_config(tmp: Path, nodes: list[str], agg: str, sched: str, interval: str = "15s",
                sched_ca: Path | None = None) -> Path:
    """The shipped prometheus.yml with only what a site fills in changed: targets, the token file,
    absolute rule paths, and (for a test) the intervals; with ``sched_ca``, the scheduler's job scraped
    over HTTPS by the lines the file has commented out for that, its CA file pointed at ``sched_ca``."""
    text = (DEPLOY / "prometheus.yml").read_text()
    if sched_ca is not None:
        commented = ("    #scheme: https\n", "    #tls_config:\n", "    #  ca_file: /etc/prometheus/dlshare-ca.pem")
        assert all(c in text for c in commented), "prometheus.yml no longer says how to scrape an HTTPS scheduler"
        for c in commented:
            text = text.replace(c, c.replace("#", "", 1))
        text = text.replace("/etc/prometheus/dlshare-ca.pem", str(sched_ca))
    conf = yaml.safe_load(text)
    conf["global"]["scrape_interval"] = conf["global"]["evaluation_interval"] = interval
    conf["rule_files"] = [str(DEPLOY / f) for f in conf["rule_files"]]
    sd = tmp / "dlshare-nodes.json"
    sd.write_text(json.dumps([{"targets": nodes, "labels": {"rack": "test"}}]))
    token = tmp / "sched.token"
    token.write_text(TOKEN + "\n")
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    assert set(jobs) == {"dlshare-node", "dlshare-agg", "dlshare-sched"}
    jobs["dlshare-node"]["file_sd_configs"][0]["files"] = [str(sd)]
    jobs["dlshare-node"]["file_sd_configs"][0]["refresh_interval"] = "1s"
    jobs["dlshare-agg"]["static_configs"] = [{"targets": [agg]}]
    jobs["dlshare-sched"]["static_configs"] = [{"targets": [sched]}]
    jobs["dlshare-sched"]["authorization"]["credentials_file"] = str(token)
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(conf, sort_keys=False))
    return path


async def test_a_real_prometheus_scrapes_every_series_the_rules_and_the_dashboard_use(mosquitto, node_daemons,
                                                                                       tmp_path):
    prometheus = _need(PROMETHEUS, "prometheus")
    ports = {k: free_port() for k in ("a", "b", "agg", "agg_metrics", "prom")}
    donor_env = {"DLSHARE_DONOR_SLAB_BYTES": str(1 << 20), "DLSHARE_DONOR_HEADROOM_BYTES": str(64 << 20),
                 "DLSHARE_DONOR_MAX_SLABS": "8"}
    run_env = {"DLSHARE_NODE_ALLOW_ROOT_JOBS": "true"}  # the test runs as root: so do its jobs
    node_daemons(mosquitto.url, "prom-a", "--fake-gpus", "2", "--lend", "--allow-run", "--metrics-listen",
                 f"127.0.0.1:{ports['a']}", interval=0.5, env={**donor_env, **run_env})
    node_daemons(mosquitto.url, "prom-b", "--fake-gpus", "2", "--allow-run", "--metrics-listen",
                 f"127.0.0.1:{ports['b']}", interval=0.5, env=run_env)
    procs: list[subprocess.Popen] = []
    # The scheduler serves HTTPS (a certificate made here), scraped as the shipped file's comments say.
    sched = SchedProc(tmp_path, mosquitto.url, profile="fifo", tls=make_test_pki(tmp_path / "pki"))
    try:
        with open(tmp_path / "agg.log", "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "nodesvc.cli", "agg", "--listen", f"127.0.0.1:{ports['agg']}",
                 "--metrics-listen", f"127.0.0.1:{ports['agg_metrics']}", "--broker", mosquitto.url, "--id", "agg-prom"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        await asyncio.to_thread(sched.start, {"DLSHARE_SCHED_HISTORY_STEP_S": "0.5", "DLSHARE_SCHED_REASONS_S": "0.2"})
        await asyncio.to_thread(wait_port, ports["agg_metrics"], procs[0], 30)
        conf = live_config(tmp_path, [f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"],
                           f"127.0.0.1:{ports['agg_metrics']}", f"127.0.0.1:{sched.port}", interval="1s",
                           sched_ca=tmp_path / "pki" / "ca.pem")
        with open(tmp_path / "prometheus.log", "ab") as log:
            procs.append(subprocess.Popen(
                [prometheus, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{ports['prom']}", "--web.enable-lifecycle"],
                stdout=log, stderr=subprocess.STDOUT))
        await asyncio.to_thread(wait_port, ports["prom"], procs[-1], 60)
        # Two jobs fill the 4 GPUs (real processes on the nodes), a third waits: the queue has a reason.
        c = sched.client()
        await until(lambda: sum(n["status"] == "online" for n in c.cluster()["nodes"]) == 2, timeout=60,
                    what="both nodes online at the scheduler")
        for jid in ("fill-1", "fill-2", "waits"):
            c.submit({"id": jid, "model": "resnet50", "gpus": 2, "cpus": 0.5, "memory_bytes": 64 << 20,
                      "command": ["sleep", "300"]})
        api = httpx.Client(base_url=f"http://127.0.0.1:{ports['prom']}", timeout=10)

        def query(q: str) -> list:
            r = api.get("/api/v1/query", params={"query": q})
            body = r.json()
            assert body["status"] == "success", (q, body)
            return body["data"]["result"]

        def targets_up() -> bool:
            ts = api.get("/api/v1/targets").json()["data"]["activeTargets"]
            return len(ts) == 4 and all(t["health"] == "up" for t in ts)

        await until_or(targets_up, lambda: [(t["scrapeUrl"], t["health"], t["lastError"]) for t in
                                            api.get("/api/v1/targets").json()["data"]["activeTargets"]],
                       60, "every target scraped and up")
        wanted: dict[str, str] = {}  # selector -> where it is used
        for where, expr in [*(("rule " + n, e) for n, e in rule_exprs()),
                            *(("dashboard panel " + t, e) for t, e in dashboard_exprs())]:
            for sel in selectors(expr):
                wanted.setdefault(sel, where)
        assert len(wanted) >= 30
        if not os.path.exists("/proc/pressure/memory"):  # a kernel without PSI: the daemon has no such series
            wanted = {s: w for s, w in wanted.items() if "pressure" not in s}

        def missing() -> list[str]:
            return [f"{s} (used by {w})" for s, w in wanted.items() if not query(f"count({s})")]

        await until_or(lambda: not missing(), missing, 60, "every selected series scraped (or recorded)")
        rules = api.get("/api/v1/rules").json()["data"]["groups"]
        bad = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"] if r["health"] != "ok"]
        assert not bad and sum(len(g["rules"]) for g in rules) == len(rule_exprs())
        empty = [f"{t}: {e}" for t, e in dashboard_exprs() if not query(e)]
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
        # What the stack really does shows through: GPUs of both nodes, one job waiting for Resources.
        assert float(query('sum(dlshare_sched_gpus{job="dlshare-sched"})')[0]["value"][1]) == 4
        await until(lambda: query('dlshare_sched_queue_length{reason="Resources"} == 1'), timeout=30,
                    what="the waiting job counted under its reason")
        await until(lambda: query('dlshare_sched_jobs{state="running"} == 2'), timeout=30, what="two jobs running")
        assert query('dlshare_donor_lendable_bytes{node="127.0.0.1"}')  # the relabelled node label
    finally:
        if sched.proc is not None:
            try:
                with sched.client() as c:
                    for jid in ("fill-1", "fill-2", "waits"):
                        c.cancel(jid)  # the nodes stop the sleeps
            except Exception:  # noqa: BLE001 - teardown goes on; the daemons' stop ends their jobs too
                pass
        for p in reversed(procs):
            stop_proc(p)
        await asyncio.to_thread(sched.stop)
