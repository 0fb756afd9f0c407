"""The live node table's entries, built from each node's telemetry (pure: no I/O).

:class:`LiveNode` holds the last telemetry figures the scheduler cares about
(the API shows it as ``ApiNode``, with the jobs the core placed there; the core
sees it as a ``scheduler.model.Node``).  :func:`apply_telemetry` folds one
validated telemetry payload in; :func:`core_node` turns an entry into the
core's ``Node``.  What runs where is the core's to know, not this table's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.model import GiB, Node, gpu_type_of


@dataclass
class LiveGpu:
    index: int
    name: str = ""
    util_percent: float | None = None
    memory_util_percent: float | None = None  # NVML's memory-bandwidth utilisation
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    simulated: bool = False


@dataclass
class LiveNode:
    id: str
    status: str = "unknown"  # online | offline | unknown
    last_seen: float | None = None
    cpu_count: int = 0
    cpu_percent: float | None = None
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    reserved_unused_bytes: int = 0
    promised_bytes: int = 0
    lendable_bytes: int = 0
    lent_bytes: int = 0
    lend_capacity_bytes: int | None = None  # a donor's slabs in all (lent + lendable now), when it says
    gpus: list[LiveGpu] = field(default_factory=list)
    gpu_reason: str | None = None
    job_usage: dict[str, dict[str, Any]] = field(default_factory=dict)
    published_at: float | None = None  # the node's clock when it published the last telemetry
    reported: tuple | None = None  # resources last reported to the core
    reported_running: tuple[str, ...] | None = None  # the running jobs it listed in that report
    reported_missing: frozenset[str] = frozenset()  # started jobs it did not list in that report
    reported_at: float = 0.0
    gpu_type_label: str = ""  # the GPU generation a Kubernetes node label names (when telemetry names none)

    @property
    def running(self) -> tuple[str, ...]:
        """The jobs the node says it runs (its telemetry's ``jobs`` that have not exited)."""
        return tuple(sorted(j for j, u in self.job_usage.items() if u.get("state") != "exited"))

    def exited(self) -> dict[str, tuple[int | None, str]]:
        """Jobs the node reports as exited: id -> (exit code (None when it does not say), the run_id
        of the run that exited ("" when it does not say))."""
        out = {}
        for j, u in self.job_usage.items():
            if u.get("state") == "exited":
                code = u.get("exit_code")
                run_id = u.get("run_id")
                out[j] = (code if isinstance(code, int) and not isinstance(code, bool) else None,
                          run_id if isinstance(run_id, str) else "")
        return out


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else 0


def apply_telemetry(node: LiveNode, t: dict[str, Any], now: float) -> None:
    """Fold a telemetry payload (already checked by ``messages.parse_telemetry``) into ``node``."""
    node.last_seen = now
    node.status = "online"
    ts = t.get("ts")
    node.published_at = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts > 0 else None
    cpu, mem, gpus = t["cpu"], t["memory"], t["gpus"]
    node.cpu_count = _int(cpu.get("count"))
    p = cpu.get("percent")
    node.cpu_percent = float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None
    node.memory_total_bytes = _int(mem["total_bytes"])
    node.memory_available_bytes = _int(mem["available_bytes"])
    node.reserved_unused_bytes = _int(mem.get("reserved_unused_bytes"))
    node.promised_bytes = _int(mem.get("promised_bytes"))
    node.gpus = []
    for i, g in enumerate(gpus.get("devices") or []):
        if not isinstance(g, dict):
            continue
        u, mu = g.get("util_percent"), g.get("memory_util_percent")
        node.gpus.append(LiveGpu(
            index=_int(g.get("index", i)), name=str(g.get("name", ""))[:100],
            util_percent=float(u) if isinstance(u, (int, float)) and not isinstance(u, bool) else None,
            memory_util_percent=float(mu) if isinstance(mu, (int, float)) and not isinstance(mu, bool) else None,
            memory_used_bytes=_int(g.get("memory_used_bytes")) or None,
            memory_total_bytes=_int(g.get("memory_total_bytes")) or None,
            simulated=bool(gpus.get("simulated"))))
    node.gpu_reason = gpus.get("reason") if isinstance(gpus.get("reason"), str) else None
    donor = t.get("donor")
    if isinstance(donor, dict):
        node.lendable_bytes = _int(donor.get("lendable_bytes", donor.get("free_bytes")))
        node.lent_bytes = _int(donor.get("lent_bytes", donor.get("used_bytes")))
        slabs, slab = donor.get("total_slabs"), donor.get("slab_bytes")
        node.lend_capacity_bytes = (_int(slabs) * _int(slab) if isinstance(slabs, int) and isinstance(slab, int)
                                    and not isinstance(slabs, bool) and not isinstance(slab, bool) else None)
    jobs = t.get("jobs")
    node.job_usage = {k: v for k, v in jobs.items() if isinstance(v, dict)} if isinstance(jobs, dict) else {}


def core_node(node: LiveNode) -> Node:
    """The core's Node for this entry: its GPUs (and their generation), cores, memory and lendable memory.  A donor's
    lendable memory, for the core, is what it could lend in all: its free lendable bytes plus what
    it lends now (its slab count when it reports one: that also shows a cap on slabs and a pause after
    a reclaim); the core's promises on it are counted against that."""
    gmem = next((g.memory_total_bytes for g in node.gpus if g.memory_total_bytes), None)
    # The GPUs' generation: from NVML's device name in telemetry, else from the node's label.
    gtype = next((t for t in (gpu_type_of(g.name) for g in node.gpus) if t), "") or node.gpu_type_label
    return Node(id=node.id, gpus=len(node.gpus), cores=max(0, node.cpu_count), memory_bytes=max(0, node.memory_total_bytes),
                lendable_bytes=(max(0, node.lend_capacity_bytes) if node.lend_capacity_bytes is not None
                                else max(0, node.lendable_bytes) + max(0, node.lent_bytes)),
                gpu_memory_bytes=gmem or 32 * GiB, gpu_type=gtype)
