"""The scheduler part of the scripted tour (``dlshare up --tour``).

Entry point: ``await run_tour(st, console)`` (also fine to call from a thread's
own loop with ``asyncio.run``).  ``st`` is the running stack, read for:

- ``st.sched_url`` and ``st.sched_token``: the scheduler API and its bearer token;
- ``st.broker_url``: the MQTT broker (remote-memory jobs find donors through it), and
  ``st.net.gateway`` when the nodes live in network namespaces (jobs reach the broker there);
- ``st.node_ids``: the node daemons that should be online;
- ``st.agg_addr``: ``HOST:PORT`` of the aggregation server, or None;
- ``st.lending``: True when the node daemons lend memory (adds the remote-memory job).

``console`` is a ``rich.console.Console``.  It returns True when every job it
submitted ended as expected.

The jobs are small and real: PyTorch trainings on the CPU (on the nodes'
simulated GPUs), data-preparation jobs that reserve more memory than they use,
a two-rank training whose gradients are averaged by the shared aggregation
service (when one runs), and a job that keeps its cache in lent remote memory
(when the nodes lend).  The tour shows where each was placed, what it was
allocated, which jobs share a node or a GPU, the memory reserved but unused
and lent, then a summary.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[2]

TRAIN = """
import os, time, torch
torch.manual_seed(int(os.environ.get("SEED", "0"))); torch.set_num_threads(1)
x = torch.randn(512, 32); w_true = torch.randn(32, 1); y = x @ w_true + 0.01 * torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
first = None
for step in range(int(os.environ.get("STEPS", "150"))):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    first = loss.item() if first is None else first
    time.sleep(0.02)
print(f"{os.environ['DLSHARE_JOB_ID']}: loss {first:.3f} -> {loss.item():.4f} on GPUs [{os.environ.get('CUDA_VISIBLE_DEVICES')}]")
assert loss.item() < first
"""

DATA_PREP = """
import os, time
buf = bytearray(int(os.environ["USE_BYTES"]))  # uses a fraction of what the job reserved
for i in range(0, len(buf), 4096): buf[i] = 1
time.sleep(float(os.environ.get("HOLD_S", "8")))
print(f"{os.environ['DLSHARE_JOB_ID']}: prepared {len(buf) >> 20} MiB of samples")
"""

AGG_TRAIN = """
import os, time, torch
from aggregator import Client
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD"])
torch.manual_seed(0); torch.set_num_threads(1)
model = torch.nn.Linear(16, 1)
g = torch.Generator().manual_seed(100 + rank)
x = torch.randn(256, 16, generator=g); y = x.sum(1, keepdim=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with Client([os.environ["AGG"]], job=os.environ["AGG_JOB"], rank=rank, world=world) as c:
    for step in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        avg = torch.from_numpy(c.allreduce(flat, op="mean", key=0))
        off = 0
        for p in model.parameters():
            n = p.numel(); p.grad.copy_(avg[off:off + n].reshape(p.shape)); off += n
        opt.step()
digest = float(sum(p.detach().double().sum() for p in model.parameters()))
print(f"rank {rank}: loss {loss.item():.4f}, parameter checksum {digest:.6f} (equal on every rank)")
"""

REMOTE_CACHE = """
import os, time, numpy as np
from rdma import RemoteMemory
with RemoteMemory(os.environ["BROKER"], replicas=int(os.environ["REPLICAS"])) as rm:
    print(f"replicas={rm.replicas}, donors seen: {sorted(rm.control.donors())}", flush=True)
    buf = rm.alloc(64 << 20)
    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    buf.write(0, data)
    time.sleep(float(os.environ.get("HOLD_S", "8")))
    back = buf.read(0, len(data))
    assert (back == data).all()
print(f"{os.environ['DLSHARE_JOB_ID']}: 64 MiB cached in lent memory on other nodes, read back intact")
"""

MEMSHORT = """
import os, numpy as np, rdma
region = rdma.region_from_env(local_bytes=8 << 20)  # budget and broker from the environment the daemon set
a = region.array(np.uint8)
a[:] = 7
assert int(a[::4096].astype(np.int64).sum()) == 7 * len(a[::4096])
budget = int(os.environ["DLSHARE_REMOTE_MEMORY_BYTES"])
print(f"{os.environ['DLSHARE_JOB_ID']}: {region.nbytes >> 20} MiB region through 8 MiB of local memory, on donors, "
      f"from the {budget >> 20} MiB of lent memory the scheduler gave it; read back intact")
region.close()
"""


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


class TourStack(Protocol):
    """What the tour reads of the running stack (``dlshare up``'s ``Stack`` has all of it)."""

    broker_url: str
    node_ids: list[str]
    sched_url: str | None
    sched_token: str | None
    agg_addr: str | None  # a shared aggregation server, when the stack runs one
    lending: bool  # the node daemons lend memory
    net: Any  # the nodes' network namespaces (with a ``gateway`` address), or None


def node_broker(st: TourStack) -> str:
    """The broker URL as a job on a node reaches it: the one the stack hands its jobs
    (``st.job_broker``: the memory consumers' credentials), else through the namespace gateway
    when ``dlshare up`` put the nodes in network namespaces (``st.net``), else ``st.broker_url``."""
    if getattr(st, "job_broker", ""):
        return st.job_broker
    gateway = st.net.gateway if st.net is not None else None
    if not gateway:
        return st.broker_url
    from urllib.parse import urlsplit

    u = urlsplit(st.broker_url)
    return f"{u.scheme}://{gateway}:{u.port or 1883}"


def tour_jobs(st: TourStack, tag: str) -> list[dict[str, Any]]:
    """The job specs the tour submits (``tag`` keeps ids unique per run)."""
    py = [sys.executable, "-c"]
    env = {"PYTHONPATH": str(ROOT)}
    jobs: list[dict[str, Any]] = []
    for i in range(3):
        jobs.append({"id": f"{tag}-train-{i}", "name": f"MLP training {i}", "kind": "training", "model": "mlp",
                     "graph_features": {"params": 2177.0, "layers": 3.0, "linear_frac": 0.67},
                     "batch_size": 512, "gpus": 1, "cpus": 0.25, "memory_bytes": 512 << 20,
                     "command": py + [TRAIN], "env": {**env, "SEED": str(i)}, "cwd": str(ROOT)})
    for i in range(2):
        jobs.append({"id": f"{tag}-prep-{i}", "name": f"data preparation {i} (reserves 1 GiB, uses 64 MiB)",
                     "kind": "data_prep", "gpus": 0, "cpus": 0.25, "memory_bytes": 1 << 30,
                     "command": py + [DATA_PREP], "env": {**env, "USE_BYTES": str(64 << 20)}, "cwd": str(ROOT)})
    if st.agg_addr and _has("aggregator.client"):
        # Two jobs, one aggregation job: the scheduler gives each job its own secret, so these two
        # ranks bring a shared one (a job's own DLSHARE_AGG_SECRET wins over the issued one).
        shared = secrets.token_hex(16)
        for r in range(2):
            jobs.append({"id": f"{tag}-ddp-r{r}", "name": f"2-rank training via aggregation, rank {r}",
                         "kind": "training", "model": "linear", "batch_size": 256, "gpus": 1, "cpus": 0.25,
                         "memory_bytes": 512 << 20, "command": py + [AGG_TRAIN], "cwd": str(ROOT),
                         "env": {**env, "RANK": str(r), "WORLD": "2", "AGG": st.agg_addr, "AGG_JOB": f"{tag}-ddp",
                                 "DLSHARE_AGG_SECRET": shared}})
    if st.lending and _has("rdma.region") and len(st.node_ids) >= 2:
        # A memory-short training job: it asks the scheduler for lent memory, which the run command
        # carries to its node and rdma.region_from_env() maps on the other nodes' donors.
        jobs.append({"id": f"{tag}-memshort", "name": "memory-short training borrowing lent memory",
                     "kind": "training", "model": "mlp", "batch_size": 512, "gpus": 1, "cpus": 0.25,
                     "memory_bytes": 256 << 20, "remote_memory_bytes": 64 << 20, "command": py + [MEMSHORT],
                     "env": env, "cwd": str(ROOT)})
    if st.lending and _has("rdma.remote") and len(st.node_ids) >= 2:
        jobs.append({"id": f"{tag}-remote-cache", "name": "data preparation caching in lent memory",
                     "kind": "data_prep", "gpus": 0, "cpus": 0.25, "memory_bytes": 256 << 20,
                     "command": py + [REMOTE_CACHE], "cwd": str(ROOT),
                     "env": {**env, "BROKER": node_broker(st), "REPLICAS": str(min(2, len(st.node_ids) - 1))}})
    return jobs


def _gib(n: int | float | None) -> str:
    return f"{(n or 0) / (1 << 30):.2f} GiB"


def _jobs_table(jobs: list[dict[str, Any]], placed: dict[str, dict[str, Any]] | None = None):
    from rich.table import Table

    t = Table("job", "kind", "state", "node", "GPU", "CPUs", "memory", "service", "note", title="jobs")
    for j in jobs:
        a, s = j.get("allocation") or (placed or {}).get(j["id"], {}).get("allocation") or {}, j["spec"]
        gpus = ",".join(f"#{g}" for g in a.get("gpus") or []) or ("-" if not s.get("gpus") else "(waiting)")
        note = j.get("reason") or ""
        if a.get("colocated_with"):
            note = "shares its GPU with " + ", ".join(a["colocated_with"])
        t.add_row(j["id"], s.get("kind", ""), j["state"], a.get("node") or "-", gpus,
                  f"{a['cpus']:.2f}" if a.get("cpus") is not None else "-",
                  _gib(a.get("memory_bytes")) if a else "-", f"{j.get('attained_service', 0):.1f}s", note)
    return t


def _nodes_table(cluster: dict[str, Any], ours: set[str]):
    from rich.table import Table

    t = Table("node", "GPUs in use", "jobs on the node", "CPUs allocated", "reserved, unused", "lendable", "lent",
              "borrows from (scheduler)", title="nodes")
    for n in cluster["nodes"]:
        mine = [j for j in n["jobs"] if j in ours]
        shared = [f"#{g['index']}: {' + '.join(g['jobs'])}" for g in n["gpus"] if len(g["jobs"]) > 1]
        t.add_row(n["id"], f"{sum(1 for g in n['gpus'] if g['jobs'])}/{len(n['gpus'])}",
                  ", ".join(mine) + (f"  [shared GPU {'; '.join(shared)}]" if shared else ""),
                  f"{n['cpus_allocated']:.2f}/{n['cpu_count']}", _gib(n["reserved_unused_bytes"]),
                  _gib(n["lendable_bytes"]), _gib(n["lent_bytes"]),
                  ", ".join(f"{d} {_gib(b)}" for d, b in sorted((n.get("borrowed_from") or {}).items())) or "-")
    return t


async def run_tour(st: TourStack, console: Any, timeout_s: float = 150.0) -> bool:
    import logging

    from scheduler.client import SchedulerClient, SchedulerApiError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per poll
    console.print("\n[bold]Scheduler[/bold]: real jobs submitted through the API "
                  f"({st.sched_url}; status page {st.sched_url}/, log in there with the token)")
    c = SchedulerClient(st.sched_url, st.sched_token, timeout=15)
    try:
        deadline = time.monotonic() + 30
        while True:
            view = await asyncio.to_thread(c.cluster)
            online = {n["id"] for n in view["nodes"] if n["status"] == "online"}
            if set(st.node_ids) <= online:
                break
            if time.monotonic() > deadline:
                console.print(f"  [red]the scheduler sees {sorted(online)} online, not {st.node_ids}[/red]")
                return False
            await asyncio.sleep(0.5)
        console.print(f"  profile [bold]{view['profile']}[/bold]; {len(online)} nodes, {view['gpus_total']} GPUs "
                      f"(simulated on this machine), {view['cpus_total']:.0f} CPUs")
        tag = f"tour{int(time.time()) % 100000}"
        specs = tour_jobs(st, tag)
        ids = []
        for spec in specs:
            job = await asyncio.to_thread(c.submit, spec)
            ids.append(job["id"])
            console.print(f"  submitted {job['id']:<24} {spec['name']}")
        bad = await asyncio.to_thread(_show_validation, c)
        console.print(f"  a malformed spec is refused before it reaches the queue: [yellow]{bad}[/yellow]")

        seen_running: dict[str, dict[str, Any]] = {}
        peak = {"lent": 0, "reserved_unused": 0, "agg_jobs": 0}
        shown = False
        start = time.monotonic()
        while True:
            jobs = [await asyncio.to_thread(c.get, j) for j in ids]
            for j in jobs:
                if j["state"] == "running" and j["allocation"]:
                    seen_running.setdefault(j["id"], j)
            running = [j for j in jobs if j["state"] == "running"]
            now_view = await asyncio.to_thread(c.cluster)
            peak["lent"] = max(peak["lent"], now_view["memory_lent_bytes"])
            peak["reserved_unused"] = max(peak["reserved_unused"],
                                          sum(n["reserved_unused_bytes"] for n in now_view["nodes"]))
            peak["agg_jobs"] = max(peak["agg_jobs"], now_view["aggregation"]["jobs"])
            if not shown and len(seen_running) >= min(len(ids), 4) and running:
                shown = True
                view = await asyncio.to_thread(c.cluster)
                console.print("\n  [bold]Placed and allocated[/bold] (while they run):")
                console.print(_jobs_table(jobs))
                console.print(_nodes_table(view, set(ids)))
                _explain(console, view, set(ids))
            if all(j["state"] in ("done", "failed", "cancelled") for j in jobs):
                break
            if time.monotonic() - start > timeout_s:
                console.print(f"  [red]jobs still not finished after {timeout_s:.0f}s; cancelling them[/red]")
                for j in jobs:
                    if j["state"] not in ("done", "failed", "cancelled"):
                        await asyncio.to_thread(c.cancel, j["id"])
                break
            await asyncio.sleep(1.0)
        jobs = [await asyncio.to_thread(c.get, j) for j in ids]
        console.print("\n  [bold]Summary[/bold]")
        console.print(_jobs_table(jobs, seen_running))
        for j in jobs:
            first = seen_running.get(j["id"])
            if j["finished_at"] and j["submitted_at"]:
                wait = (j["started_at"] or j["finished_at"]) - j["submitted_at"]
                console.print(f"  {j['id']:<24} {j['state']:<7} on {(first or {}).get('allocation', {}).get('node', '-'):<8}"
                              f" waited {wait:5.1f}s, ran {j['finished_at'] - (j['started_at'] or j['finished_at']):5.1f}s")
        console.print(f"  while they ran: lent memory in use peaked at {_gib(peak['lent'])}, memory reserved but "
                      f"unused at {_gib(peak['reserved_unused'])}, aggregation jobs at {peak['agg_jobs']}")
        ok = all(j["state"] == "done" for j in jobs)
        console.print(f"  {sum(j['state'] == 'done' for j in jobs)}/{len(jobs)} jobs done"
                      + ("" if ok else "; job output is in the node logs under the stack's state directory"))
        return ok
    except SchedulerApiError as exc:
        console.print(f"  [red]scheduler API error: {exc}[/red]")
        return False
    finally:
        c.close()


def _show_validation(c) -> str:
    from scheduler.client import SchedulerApiError

    try:
        c.submit({"gpus": -1, "cpus": 0, "command": []})
    except SchedulerApiError as exc:
        return str(exc)
    return "(accepted: that is a bug)"


def _explain(console, view: dict[str, Any], ours: set[str]) -> None:
    for n in view["nodes"]:
        mine = [j for j in n["jobs"] if j in ours]
        kinds = {"gpu": [], "cpu": []}
        gpu_jobs = {j for g in n["gpus"] for j in g["jobs"]}
        for j in mine:
            kinds["gpu" if j in gpu_jobs else "cpu"].append(j)
        if kinds["gpu"] and kinds["cpu"]:
            console.print(f"  co-located on {n['id']}: GPU training {', '.join(kinds['gpu'])} beside data preparation "
                          f"{', '.join(kinds['cpu'])}, which uses cores and memory the trainings did not ask for")
        elif len(mine) > 1:
            console.print(f"  co-located on {n['id']}: {', '.join(mine)} share its CPUs and memory "
                          f"({n['cpus_allocated']:.2f} of {n['cpu_count']} cores allocated"
                          + (", each training on its own GPU)" if kinds["gpu"] else ")"))
        for g in n["gpus"]:
            if len(g["jobs"]) > 1:
                console.print(f"  GPU #{g['index']} on {n['id']} is shared by {' and '.join(g['jobs'])} "
                              f"(the profile predicted the pair gains from sharing)")
    console.print(f"  memory reserved but unused across nodes: "
                  f"{_gib(sum(n['reserved_unused_bytes'] for n in view['nodes']))}; lendable "
                  f"{_gib(view['memory_lendable_bytes'])}; lent now {_gib(view['memory_lent_bytes'])}")
