"""The aggregation server's settings: the ``[agg]`` config section, :func:`resolve` (its checks) and
:class:`ServerSettings` (what an :class:`~aggregator.server.AggregationServer` is built from).

Kept apart from the server so that the config section is known to every ``dlshare`` command (one
config file serves them all) without loading the server, its pool or its MQTT code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aggregator.core import DEFAULT_MAX_JOB_BYTES
from aggregator.protocol import MAX_CHUNK_BYTES
from nodesvc.bus import config
from nodesvc.bus.procs import split_hostport

# Per-connection receive buffer.  A held-back job (``interleave``) can still push this much per
# connection; 256 KiB keeps that small next to a round and still fills a 10 Gbit/s link at
# 200 us RTT from a single connection (raise it for long fat networks).
RECV_BUF = 256 << 10
config.register_section("agg", {
    "listen": "127.0.0.1:7700",
    "id": "agg0",
    "min_cores": 1,
    "max_cores": 0,  # 0: every CPU of the machine
    "round_timeout_s": 30.0,
    "telemetry_interval_s": 2.0,
    "max_job_bytes": 4 << 30,  # unfinished reductions one job may hold in server memory
    "interleave": True,  # overlapping rounds of different jobs are read first come, first served
    "recv_buffer_bytes": RECV_BUF,  # per connection; bounds what a held-back job pushes meanwhile
    "require_secret": False,  # refuse a HELLO without a job secret (otherwise the first HELLO sets it or none)
    "max_jobs_per_peer": 64,  # jobs one peer address may hold connections in at once (0: no limit)
    "hello_timeout_s": 10.0,  # a connection must be registered (HELLO accepted) within this
    "frame_timeout_s": 10.0,  # each header and payload must arrive within this of its start
    "max_connections": 1024,
    "max_connections_per_peer": 256,  # per peer IP address
    "max_receiving_bytes": 1 << 30,  # payload bytes being received at once, all peers
    "max_receiving_bytes_per_peer": 256 << 20,  # ... and per peer IP address
    "trace_file": "",  # record every chunk's stage times (aggregator/stages.py) and write them here at exit
    "metrics_listen": "127.0.0.1:9466",  # Prometheus endpoint (aggregator/metrics.py); port -1 disables it
})


def resolve(cfg: dict) -> dict:
    """Fill derived values (max_cores 0 -> CPU count) and check the section."""
    a = dict(cfg["agg"])
    if a["max_cores"] <= 0:
        a["max_cores"] = max(a["min_cores"], os.cpu_count() or 1)
    if not 1 <= a["min_cores"] <= a["max_cores"]:
        raise config.ConfigError(f"agg.min_cores ({a['min_cores']}) must be 1..max_cores ({a['max_cores']})")
    if a["max_job_bytes"] <= 0:
        raise config.ConfigError("agg.max_job_bytes must be positive")
    if a["round_timeout_s"] <= 0:
        raise config.ConfigError("agg.round_timeout_s must be positive")
    if not 4096 <= a["recv_buffer_bytes"] <= 1 << 30:
        raise config.ConfigError("agg.recv_buffer_bytes must be 4096..1073741824")
    for key in ("hello_timeout_s", "frame_timeout_s"):
        if not 0.05 <= a[key] <= 3600:
            raise config.ConfigError(f"agg.{key} must be 0.05..3600 seconds")
    if not 1 <= a["max_connections_per_peer"] <= a["max_connections"] <= 100_000:
        raise config.ConfigError("agg.max_connections_per_peer must be 1..max_connections (at most 100000)")
    if not 0 <= a["max_jobs_per_peer"] <= 1_000_000:
        raise config.ConfigError("agg.max_jobs_per_peer must be 0 (no limit)..1000000")
    mhost, _, mport = str(a["metrics_listen"]).rpartition(":")
    if not (mport.isascii() and mport.removeprefix("-").isdigit()) or not -1 <= int(mport) <= 65535:
        raise config.ConfigError(f"agg.metrics_listen must be HOST:PORT (port -1 turns metrics off), "
                                 f"got {a['metrics_listen']!r}")
    if not MAX_CHUNK_BYTES <= a["max_receiving_bytes_per_peer"] <= a["max_receiving_bytes"]:
        raise config.ConfigError(f"agg.max_receiving_bytes_per_peer must be {MAX_CHUNK_BYTES} (one chunk)"
                                 f"..max_receiving_bytes")
    return {**cfg, "agg": a}


@dataclass(frozen=True)
class ServerSettings:
    """Everything an :class:`AggregationServer` is set up with, in one object: the ``[agg]`` config
    keys of the same names (the module docstring's ceilings), plus ``interleave`` (read overlapping
    rounds of different jobs first come, first served, aggregator/interleave.py), ``recv_buffer_bytes``
    (each connection's receive buffer, which bounds what a held-back job can still push meanwhile) and
    ``trace`` (record every chunk's stage times, aggregator/stages.py)."""

    host: str = "127.0.0.1"
    port: int = 0
    server_id: str = "agg0"
    min_cores: int = 1
    max_cores: int = 4
    round_timeout_s: float = 30.0
    tick_s: float = 0.1
    shrink_after_s: float = 1.0
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES
    interleave: bool = True
    recv_buffer_bytes: int = RECV_BUF
    require_secret: bool = False
    hello_timeout_s: float = 10.0
    frame_timeout_s: float = 10.0
    max_connections: int = 1024
    max_connections_per_peer: int = 256
    max_receiving_bytes: int = 1 << 30
    max_receiving_bytes_per_peer: int = 256 << 20
    max_jobs_per_peer: int = 64
    trace: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "ServerSettings":
        """From a config (checked and completed by :func:`resolve`)."""
        a = resolve(cfg)["agg"]
        host, port = split_hostport(a["listen"], 7700)
        return cls(host=host, port=port, server_id=a["id"], min_cores=int(a["min_cores"]),
                   max_cores=int(a["max_cores"]), round_timeout_s=float(a["round_timeout_s"]),
                   max_job_bytes=int(a["max_job_bytes"]), interleave=bool(a["interleave"]),
                   recv_buffer_bytes=int(a["recv_buffer_bytes"]), require_secret=bool(a["require_secret"]),
                   hello_timeout_s=float(a["hello_timeout_s"]), frame_timeout_s=float(a["frame_timeout_s"]),
                   max_connections=int(a["max_connections"]),
                   max_connections_per_peer=int(a["max_connections_per_peer"]),
                   max_receiving_bytes=int(a["max_receiving_bytes"]),
                   max_receiving_bytes_per_peer=int(a["max_receiving_bytes_per_peer"]),
                   max_jobs_per_peer=int(a["max_jobs_per_peer"]), trace=bool(a["trace_file"]))
