"""``dlshare bench k8s``: a Philly VC slice replayed through a real kube-apiserver and kube-scheduler.

* **Control plane:** ``scheduler.service.k8s_testbed`` (etcd, kube-apiserver and kube-scheduler 1.20
  built by ``make k8s-testbed``), ``--k8s-nodes`` nodes of 8 GPUs (``nvidia.com/gpu``; Philly's jobs
  have 1-8 GPUs and a pod runs on one node), each with a ``dlshare node --fake-gpus 8`` daemon; the
  pod-lifecycle driver plays the kubelets (a bound pod runs for its scaled duration, then Succeeded).
* **Trace:** the first ``--k8s-jobs`` jobs of philly/vc_0e4a51, arrivals scaled to span ``--k8s-span-s``
  seconds and durations scaled so that the offered load (GPU-seconds asked / GPU-seconds the cluster
  has over the span) is ``--k8s-load`` (above 1: a queue forms), at least ``--k8s-min-s`` each.
* **Runs, interleaved ``--k8s-reps`` times:** (a) kube-scheduler alone (the shipped config without its
  extender: GPUs as an extended resource); (b) kube-scheduler with the dlshare extender (the shipped
  config as v1beta1), with a ``kill -9`` of ``dlshare sched`` at 40 % of the span (restarted at once) and
  a kube-apiserver restart at 60 %; (b') the same with ``[sched] k8s_order`` (the extender refuses a pod
  while one ahead of it in dlshare's order fits), no faults; (c) ``dlshare sim`` on the same scaled slice (profiles dlshare and
  fifo), the cluster the same.  Every pod is created at its arrival time with the same spec in (a) and (b).
* **Metrics:** mean and p99 JCT (creation to Succeeded), pods completed, the extender's latency per call
  (measured by a forwarding proxy between kube-scheduler and dlshare: what kube-scheduler waits, plus
  one loopback hop), and pods lost (never Succeeded) or bound twice (a pod seen on two nodes, or held
  twice in dlshare's books).

What the extender protocol cannot express bounds (b): kube-scheduler keeps its own queue order (FIFO by
priority), never puts two pods on one GPU (an extended resource is an integer count) and never preempts
for dlshare; the extender only filters and scores nodes.  (c) with profile dlshare co-locates and
preempts; (c) fifo is the prediction for (a).
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench import report, trace_replay
from bench.trace_replay import percentile

GPUS, CPUS, MEM_MB = 8, 2, 24000  # per node (the simulator's cluster; the node daemons report this host's CPUs)


def add_arguments(parser, seen: set[str]) -> None:
    for flag, kw in (("--k8s-jobs", dict(type=int, default=60, help="first N jobs of vc_0e4a51 (k8s)")),
                     ("--k8s-nodes", dict(type=int, default=3, help="nodes of 8 GPUs (k8s)")),
                     ("--k8s-span-s", dict(type=float, default=120.0, help="arrivals scaled to this span (k8s)")),
                     ("--k8s-load", dict(type=float, default=1.5, help="offered load over the span (k8s)")),
                     ("--k8s-min-s", dict(type=float, default=2.0, help="shortest scaled job, s (k8s)")),
                     ("--k8s-reps", dict(type=int, default=1, help="interleaved repetitions of (a), (b), (c) (k8s)"))):
        if flag not in seen:
            parser.add_argument(flag, **kw)
            seen.add(flag)


def scaled_trace(n: int, span_s: float, load: float, min_s: float, nodes: int) -> tuple[list[Any], float, float]:
    """The slice, arrivals over ``span_s``, durations scaled to the offered ``load``: (trace, arrival
    scale, duration scale)."""
    from scheduler import data
    from scheduler.trace import TraceJob, load_trace

    full = [t for t in load_trace(data.path("philly/vc_0e4a51.csv")) if t.gpus <= GPUS][:n]
    t0 = full[0].arrival_s
    a_scale = span_s / max(max(t.arrival_s - t0 for t in full), 1.0)
    asked = sum(t.gpus * t.duration_s for t in full)
    d_scale = load * span_s * nodes * GPUS / asked
    return [TraceJob(t.id, (t.arrival_s - t0) * a_scale, t.model, t.batch_size, t.gpus, t.steps,
                     max(min_s, t.duration_s * d_scale)) for t in full], a_scale, d_scale


def simulate(trace: list[Any], nodes: int) -> dict[str, dict[str, float]]:
    return trace_replay.simulate(trace, nodes, GPUS, CPUS, MEM_MB)


class TimingProxy:
    """Forwards kube-scheduler's extender calls to dlshare and times each (ms, by verb); a refused
    connection (dlshare down) is answered 502, as kube-scheduler would see it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.times: dict[str, list[float]] = {}
        self.failed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                t0 = time.perf_counter()
                try:
                    c = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=10)
                    c.request("POST", self.path, body, {"Content-Type": "application/json"})
                    r = c.getresponse()
                    status, data = r.status, r.read()
                    c.close()
                except OSError:
                    proxy.failed += 1
                    status, data = 502, b'{"Error": "dlshare unreachable"}'
                else:
                    verb = self.path.rstrip("/").rsplit("/", 1)[-1]
                    proxy.times.setdefault(verb, []).append((time.perf_counter() - t0) * 1000)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "TimingProxy":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def live_run(mode: str, trace: list[Any], kube: Any, root: Path, node_names: list[str], timeout_s: float,
             span_s: float, tag: str) -> dict[str, Any]:
    """One replay: ``alone`` (kube-scheduler without the extender) or ``dlshare``."""
    import yaml

    from nodesvc.bus.procs import wait_until
    from scheduler.service import k8s_testbed as tb

    dl = proxy = None
    shipped = yaml.safe_load((tb.DEPLOY / "scheduler-config.yaml").read_text())
    api = kube.client()
    driver = tb.PodDriver(kube, interval=0.2)
    created: dict[str, float] = {}
    events: list[str] = []
    try:
        if mode in ("dlshare", "order"):
            dl = tb.Dlshare(root / f"dlshare-{tag}", kube, {n: GPUS for n in node_names}, predictors="data",
                            env={"DLSHARE_SCHED_K8S_ORDER": "true"} if mode == "order" else None).start()
            proxy = TimingProxy(dl.port).start()
            kube.start_scheduler(tb.v1beta1_config(shipped, f"http://127.0.0.1:{proxy.port}/k8s", kube.kubeconfig))
        else:
            kube.start_scheduler(tb.v1beta1_config(shipped, "", kube.kubeconfig))
        driver.start()
        time.sleep(1.0)  # kube-scheduler's informers synced
        t0 = time.time()
        pending_faults = [(0.4 * span_s, "kill9"), (0.6 * span_s, "apiserver")] if mode == "dlshare" else []
        for i, t in enumerate(trace):
            while (now := time.time()) < t0 + t.arrival_s:
                if pending_faults and now >= t0 + pending_faults[0][0]:
                    _, fault = pending_faults.pop(0)
                    if fault == "kill9":
                        dl.kill9_sched()
                        dl.start_sched()
                    else:
                        kube.restart_apiserver()
                    events.append(f"{fault}@{now - t0:.1f}s")
                time.sleep(min(0.05, max(0.0, t0 + t.arrival_s - now)))
            name = f"{tag}-{i}"
            for attempt in range(50):  # the API server may be restarting
                try:
                    api.create_pod(name, gpus=t.gpus, duration_s=t.duration_s, cpu="50m", memory="64Mi",
                                   annotations={"dlshare.io/model": t.model, "dlshare.io/batch-size": str(t.batch_size)})
                    break
                except tb.TestbedError as exc:
                    if " 409 " in str(exc):  # created before the answer was lost
                        break
                    time.sleep(0.2)
                except Exception:  # noqa: BLE001 - httpx: the API server is restarting
                    time.sleep(0.2)
            created[name] = time.time()

        def done() -> bool:
            return sum(1 for n in created if driver.pods.get(n, {}).get("ended")) == len(created)

        try:
            wait_until(done, timeout=timeout_s, what=f"{mode}: every pod Succeeded", interval=0.5)
        except TimeoutError:
            pass
        jct = [driver.pods[n]["ended"] - created[n] for n in created if driver.pods.get(n, {}).get("ended")]
        bound_twice = len(driver.bound_twice)
        held_after = None
        if dl is not None:  # every pod ended: dlshare must hold none of them (its books == the API server's)
            try:
                held_after = wait_until(lambda: _held(dl) == 0 or None, timeout=15, what="dlshare released all",
                                        interval=0.5)
                held_after = 0
            except TimeoutError:
                held_after = _held(dl)
        out = {"pods_total": len(created), "pods_completed": len(jct),
               "mean_jct_s": sum(jct) / len(jct) if jct else None, "p99_jct_s": percentile(jct, 0.99),
               "makespan_s": (max(driver.pods[n]["ended"] for n in created if driver.pods.get(n, {}).get("ended"))
                              - t0) if jct else None,
               "lost": len(created) - len(jct), "bound_twice": bound_twice, "faults": events}
        if dl is not None:
            out["dlshare_held_after_end"] = held_after
            out["extender_calls"] = {v: len(xs) for v, xs in proxy.times.items()}
            out["extender_failed_calls"] = proxy.failed
            out["extender_ms"] = {v: {"p50": percentile(xs, 0.5), "p99": percentile(xs, 0.99)} for v, xs in proxy.times.items()}
            allx = [x for xs in proxy.times.values() for x in xs]
            out["extender_p99_ms"] = percentile(allx, 0.99)
        return out
    finally:
        driver.stop()
        kube.stop_scheduler()
        for p in api.pods():
            api.delete_pod("default", p["metadata"]["name"])
        api.close()
        if proxy is not None:
            proxy.stop()
        if dl is not None:
            dl.stop()


def _held(dl: Any) -> int:
    try:
        return sum(len(n["jobs"]) for n in dl.client().cluster()["nodes"])
    except Exception:  # noqa: BLE001 - not answering counts as unknown
        return -1


def run(args) -> dict[str, Any]:
    from scheduler.service import k8s_testbed as tb

    try:
        tb.find_binaries()
    except tb.TestbedError as exc:
        raise SystemExit(f"bench k8s: {exc}") from None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n, span, nodes, reps = args.k8s_jobs, args.k8s_span_s, args.k8s_nodes, args.k8s_reps
    if getattr(args, "quick", False):
        n, span, nodes = min(n, 40), min(span, 60.0), min(nodes, 2)
    trace, a_scale, d_scale = scaled_trace(n, span, args.k8s_load, args.k8s_min_s, nodes)
    print(f"k8s: {len(trace)} jobs of vc_0e4a51, arrivals x {a_scale:.3g} over {span:.0f} s, durations x "
          f"{d_scale:.3g} (offered load {args.k8s_load:g}) on {nodes}x{GPUS} GPUs", flush=True)
    sims, runs = [], {"alone": [], "dlshare": [], "order": []}
    names = [f"kn{i + 1}" for i in range(nodes)]
    with tempfile.TemporaryDirectory(prefix="dlshare-bench-k8s-") as tmp:
        kube = tb.LocalKube(Path(tmp) / "kube").start()
        try:
            api = kube.client()
            for name in names:
                api.create_node(name, GPUS, cpus=64)
            api.close()
            for r in range(reps):
                for mode in ("alone", "dlshare", "order", "sim"):
                    print(f"k8s: rep {r + 1}/{reps}: {mode} ...", flush=True)
                    if mode == "sim":
                        sims.append(simulate(trace, nodes))
                        print("k8s: sim: " + json.dumps(sims[-1]), flush=True)
                        continue
                    timeout = 4 * span + 4 * max(t.duration_s for t in trace) + 120
                    res = live_run(mode, trace, kube, Path(tmp), names, timeout, span, f"{mode[0]}{r}")
                    runs[mode].append(res)
                    print(f"k8s: {mode}: " + json.dumps(res, default=str), flush=True)
        finally:
            kube.stop()

    def mean_of(mode: str, key: str) -> float | None:
        xs = [x[key] for x in runs[mode] if x.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    a_jct, b_jct, o_jct = mean_of("alone", "mean_jct_s"), mean_of("dlshare", "mean_jct_s"), mean_of("order", "mean_jct_s")
    sim_d = sum(s["dlshare"]["mean_jct_s"] for s in sims) / len(sims)
    sim_f = sum(s["fifo"]["mean_jct_s"] for s in sims) / len(sims)
    total = sum(x["pods_total"] for m in runs.values() for x in m)
    completed = sum(x["pods_completed"] for m in runs.values() for x in m)
    lost_twice = sum(x["lost"] + x["bound_twice"] for m in ("dlshare", "order") for x in runs[m]) + sum(
        1 for m in ("dlshare", "order") for x in runs[m] if x.get("dlshare_held_after_end"))
    p99s = [x["extender_p99_ms"] for x in runs["dlshare"] if x.get("extender_p99_ms") is not None]
    metrics = {
        "jobs": len(trace), "nodes": nodes, "gpus_per_node": GPUS, "span_s": span, "offered_load": args.k8s_load,
        "arrival_scale": a_scale, "duration_scale": d_scale, "reps": reps,
        "k8s_pods_total": total, "k8s_pods_completed": completed,
        "k8s_completed_fraction": completed / total if total else None,
        "k8s_lost_or_bound_twice": lost_twice,
        "k8s_default_mean_jct_s": a_jct, "k8s_default_p99_jct_s": mean_of("alone", "p99_jct_s"),
        "k8s_dlshare_mean_jct_s": b_jct, "k8s_dlshare_p99_jct_s": mean_of("dlshare", "p99_jct_s"),
        "sim_dlshare_mean_jct_s": sim_d, "sim_fifo_mean_jct_s": sim_f,
        "k8s_mean_jct_vs_default": b_jct / a_jct if a_jct and b_jct else None,
        "k8s_mean_jct_vs_sim": b_jct / sim_d if b_jct and sim_d else None,
        "k8s_default_vs_sim_fifo": a_jct / sim_f if a_jct and sim_f else None,
        "k8s_extender_p99_ms": max(p99s) if p99s else None,
        "k8s_order_mean_jct_s": o_jct, "k8s_order_p99_jct_s": mean_of("order", "p99_jct_s"),
        "k8s_order_mean_jct_vs_default": o_jct / a_jct if a_jct and o_jct else None,
        "k8s_order_extender_p99_ms": max((x["extender_p99_ms"] for x in runs["order"]
                                          if x.get("extender_p99_ms") is not None), default=None),
        "runs": runs, "sim": sims,
    }
    rows = [
        {"run": "(a) kube-scheduler alone", "mean JCT s": a_jct, "p99 JCT s": metrics["k8s_default_p99_jct_s"],
         "lost": sum(x["lost"] for x in runs["alone"]), "bound twice": sum(x["bound_twice"] for x in runs["alone"])},
        {"run": "(b) kube-scheduler + dlshare extender (kill -9, apiserver restart)", "mean JCT s": b_jct,
         "p99 JCT s": metrics["k8s_dlshare_p99_jct_s"], "lost": sum(x["lost"] for x in runs["dlshare"]),
         "bound twice": sum(x["bound_twice"] for x in runs["dlshare"])},
        {"run": "(b') with the extender and k8s_order (dlshare's order by refusal)", "mean JCT s": o_jct,
         "p99 JCT s": metrics["k8s_order_p99_jct_s"], "lost": sum(x["lost"] for x in runs["order"]),
         "bound twice": sum(x["bound_twice"] for x in runs["order"])},
        {"run": "(c) simulator, profile dlshare", "mean JCT s": sim_d},
        {"run": "(c) simulator, profile fifo", "mean JCT s": sim_f},
    ]
    print(report.markdown_table(rows))
    targets = report.target_rows([
        ("k8s_pods_completed / k8s_pods_total", metrics["k8s_completed_fraction"], "==", 1.0),
        ("k8s_lost_or_bound_twice", float(lost_twice), "==", 0.0),
        ("k8s_mean_jct_vs_default", metrics["k8s_mean_jct_vs_default"], "<=", 0.8),
        ("k8s_mean_jct_vs_sim", metrics["k8s_mean_jct_vs_sim"], "<=", 1.15),
        ("k8s_extender_p99_ms", metrics["k8s_extender_p99_ms"], "<=", 100.0),
    ])
    print(report.markdown_table(targets))
    return report.envelope("k8s", metrics, table=rows, targets=targets)
