"""Prometheus metrics for the node daemon, named as node_exporter and the DCGM exporter name theirs.

Host figures are rendered from the latest telemetry snapshot by a custom
collector (so the metrics and MQTT telemetry always agree); the daemon's own
counters are ordinary prometheus-client counters.  Served on 127.0.0.1 by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class TelemetryCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], node: str) -> None:
        self.snapshot = snapshot
        self.node = node

    def collect(self):
        t = self.snapshot()
        times = CounterMetricFamily("node_cpu_seconds_total", "Seconds the CPUs spent in each mode.",
                                    labels=["cpu", "mode"])
        for i, ct in enumerate(psutil.cpu_times(percpu=True)):
            for mode in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"):
                if hasattr(ct, mode):
                    times.add_metric([str(i), mode], getattr(ct, mode))
        yield times
        if not t:
            return
        mem = t["memory"]
        yield GaugeMetricFamily("node_memory_MemTotal_bytes", "Memory information field MemTotal_bytes.",
                                value=mem["total_bytes"])
        yield GaugeMetricFamily("node_memory_MemAvailable_bytes", "Memory information field MemAvailable_bytes.",
                                value=mem["available_bytes"])
        for i, name in enumerate(("node_load1", "node_load5", "node_load15")):
            yield GaugeMetricFamily(name, f"{name[9:]}m load average.", value=t["cpu"]["load"][i])
        psi = mem.get("psi", {})
        if "some_total_us" in psi:
            yield CounterMetricFamily("node_pressure_memory_waiting_seconds_total",
                                      "Total time in seconds that processes have waited for memory",
                                      value=psi["some_total_us"] / 1e6)
        if "full_total_us" in psi:
            yield CounterMetricFamily("node_pressure_memory_stalled_seconds_total",
                                      "Total time in seconds no process could make progress due to memory congestion",
                                      value=psi["full_total_us"] / 1e6)
        # DCGM exporter names and units (FB in MiB, power in W, clocks in MHz).
        labels = ["gpu", "UUID", "modelName", "Hostname"]
        fams = {
            "DCGM_FI_DEV_GPU_UTIL": GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=labels),
            "DCGM_FI_DEV_FB_USED": GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=labels),
            "DCGM_FI_DEV_FB_FREE": GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=labels),
            "DCGM_FI_DEV_SM_CLOCK": GaugeMetricFamily("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", labels=labels),
            "DCGM_FI_DEV_POWER_USAGE": GaugeMetricFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels=labels),
        }
        for d in t["gpus"].get("devices", []):
            lv = [str(d["index"]), d.get("uuid") or "", d.get("name") or "", self.node]
            if d.get("util_percent") is not None:
                fams["DCGM_FI_DEV_GPU_UTIL"].add_metric(lv, d["util_percent"])
            if d.get("memory_used_bytes") is not None and d.get("memory_total_bytes") is not None:
                fams["DCGM_FI_DEV_FB_USED"].add_metric(lv, d["memory_used_bytes"] / 2**20)
                fams["DCGM_FI_DEV_FB_FREE"].add_metric(lv, (d["memory_total_bytes"] - d["memory_used_bytes"]) / 2**20)
            if d.get("sm_clock_mhz") is not None:
                fams["DCGM_FI_DEV_SM_CLOCK"].add_metric(lv, d["sm_clock_mhz"])
            if d.get("power_w") is not None:
                fams["DCGM_FI_DEV_POWER_USAGE"].add_metric(lv, d["power_w"])
        yield from fams.values()
        jr = GaugeMetricFamily("dlshare_job_memory_rss_bytes", "Resident memory of a job's processes.", labels=["job"])
        jc = GaugeMetricFamily("dlshare_job_cpu_ratio", "CPU use of a job's processes, in cores.", labels=["job"])
        for job, j in t.get("jobs", {}).items():
            if j.get("state") == "running":
                jr.add_metric([job], j.get("rss_bytes", 0))
                jc.add_metric([job], j.get("cpu_percent", 0.0) / 100.0)
        yield jr
        yield jc
        donor = t.get("donor")
        if isinstance(donor, dict):
            for key in ("lendable_bytes", "lent_bytes"):
                if isinstance(donor.get(key), int):
                    yield GaugeMetricFamily(f"dlshare_donor_{key}", f"Remote memory {key[:-6]} by this node.",
                                            value=donor[key])
            if isinstance(donor.get("evicting"), list):
                yield GaugeMetricFamily("dlshare_donor_evicting_slabs",
                                        "Lent slabs being taken back now (their consumers are moving the data).",
                                        value=len(donor["evicting"]))
            if isinstance(donor.get("last_reclaim_s"), (int, float)):
                yield GaugeMetricFamily("dlshare_donor_last_reclaim_seconds",
                                        "How long the last slab taken back took to return.",
                                        value=donor["last_reclaim_s"])
            for key, doc in (("maps", "Slabs lent (map commands served)."),
                             ("refused_maps", "Map commands refused (nothing left to lend)."),
                             ("evictions", "Lent slabs taken back because this node needed its memory."),
                             ("forced_unmaps", "Lent slabs unmapped before their consumer let go (deadline, lease).")):
                if isinstance(donor.get(key), int):
                    yield CounterMetricFamily(f"dlshare_donor_{key}", doc, value=donor[key])


class NodeMetrics:
    def __init__(self, node: str, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(TelemetryCollector(snapshot, node))
        self.commands = Counter("dlshare_node_commands", "Commands handled, by op and result.",
                                ["op", "result"], registry=self.registry)
        self.bad_messages = Counter("dlshare_node_bad_messages", "Malformed messages received.",
                                    registry=self.registry)
        self.telemetry = Counter("dlshare_node_telemetry_published", "Telemetry messages published.",
                                 registry=self.registry)
        self.connected = Gauge("dlshare_node_broker_connected", "1 while connected to the MQTT broker.",
                               registry=self.registry)
        self.connects = Counter("dlshare_node_broker_connects", "Successful broker (re)connections.",
                                registry=self.registry)
        self.server = None

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (0 picks a free one)."""
        self.server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
