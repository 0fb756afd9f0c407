"""dlshare node service: telemetry, MQTT bus, cgroup enforcement, metrics, CLI."""

__version__ = "0.1.0"
