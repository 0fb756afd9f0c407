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

from nodesvc.bus.messages import NodeTelemetry
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


def apply_telemetry(node: LiveNode, t: NodeTelemetry, now: float) -> None:
    """Fold a node's typed telemetry (``messages.parse_telemetry``) into ``node``."""
    node.last_seen = now
    node.status = "online"
    node.published_at = t.ts
    node.cpu_count = t.cpu_count
    node.cpu_percent = t.cpu_percent
    node.memory_total_bytes = t.memory_total_bytes
    node.memory_available_bytes = t.memory_available_bytes
    node.reserved_unused_bytes = t.reserved_unused_bytes
    node.promised_bytes = t.promised_bytes
    node.gpus = [LiveGpu(index=g.index, name=g.name, util_percent=g.util_percent,
                         memory_util_percent=g.memory_util_percent, memory_used_bytes=g.memory_used_bytes,
                         memory_total_bytes=g.memory_total_bytes, simulated=t.gpus_simulated) for g in t.gpus]
    node.gpu_reason = t.gpu_reason
    d = t.donor
    if d is not None:
        node.lendable_bytes = d.lendable_bytes
        node.lent_bytes = d.lent_bytes
        node.lend_capacity_bytes = (d.total_slabs * d.slab_bytes if d.total_slabs is not None and d.slab_bytes
                                    else None)
    node.job_usage = dict(t.jobs)


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
