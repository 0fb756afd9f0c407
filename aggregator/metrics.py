"""Prometheus metrics of an aggregation server (``agg.metrics_listen``, 127.0.0.1:9466 by default).

A custom collector renders ``server.stats()`` (the figures its MQTT telemetry carries) at each
scrape, so the two always agree.  ``server`` is any object with ``stats()`` (see
:meth:`aggregator.server.AggregationServer.stats`).  Names follow Prometheus's conventions: base
units, ``_total`` for counters.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("dlshare.agg")


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


class AggregationCollector:
    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self):
        st = self.server.stats()
        pool = st.get("pool") or {}
        info = GaugeMetricFamily("dlshare_agg_info", "The aggregation server: its id and address.",
                                 labels=["server", "address", "kernel"])
        info.add_metric([str(st.get("server", "")), str(st.get("address", "")), str(st.get("kernel", ""))], 1)
        yield info
        gauges = (
            ("dlshare_agg_pool_cores", "Cores the elastic reduction pool holds now.", pool.get("size")),
            ("dlshare_agg_pool_min_cores", "The pool's lower bound (agg.min_cores).", pool.get("min")),
            ("dlshare_agg_pool_max_cores", "The pool's upper bound (agg.max_cores).", pool.get("max")),
            ("dlshare_agg_pool_busy_ratio", "Share of the pool's cores busy over the last sample.",
             pool.get("busy_fraction")),
            ("dlshare_agg_pool_demand_cores", "Cores' worth of reduction work demanded.", pool.get("demand_cores")),
            ("dlshare_agg_pool_queued_tasks", "Reduction tasks waiting for a pool thread.", pool.get("queued")),
            ("dlshare_agg_jobs", "Training jobs registered on this server.", len(st.get("jobs") or {})),
            ("dlshare_agg_connections", "Open rank connections.", st.get("connections")),
            ("dlshare_agg_io_threads", "I/O worker threads alive.", st.get("io_threads")),
            ("dlshare_agg_receiving_bytes", "Payload bytes being received now.", st.get("receiving_bytes")),
            ("dlshare_agg_draining", "1 while the server is being drained.", 1 if st.get("draining") else 0),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=_num(value))
        counters = (
            ("dlshare_agg_received_bytes", "Bytes received from ranks.", st.get("bytes_in")),
            ("dlshare_agg_sent_bytes", "Bytes sent to ranks.", st.get("bytes_out")),
            ("dlshare_agg_refused_connections", "Connections refused at accept (limits).", st.get("refused_connections")),
            ("dlshare_agg_pool_busy_seconds", "Core-seconds the pool's threads spent reducing.", pool.get("busy_seconds")),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=_num(value))


class AggregationMetrics:
    """The registry and its HTTP endpoint."""

    def __init__(self, server: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(AggregationCollector(server))
        self.http = None

    def serve(self, host: str, port: int) -> int:
        """Start the endpoint; returns the bound port (0 picks a free one)."""
        self.http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self.http.server_port

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None


__all__ = ["AggregationCollector", "AggregationMetrics"]
