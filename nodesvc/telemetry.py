"""Node telemetry collectors (psutil, /proc/pressure, NVML, RDMA devices).

Pure parsers (:func:`parse_psi`) are separate from the readers so that they can
be tested and fuzzed on their own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import psutil


def parse_psi(text: str) -> dict[str, float]:
    """Parse /proc/pressure/* text into ``{"some_avg10": .., "some_total_us": .., "full_...": ..}``.

    Unknown fields are ignored; malformed lines raise ValueError.
    """
    out: dict[str, float] = {}
    for line in text.strip().splitlines():
        parts = line.split()
        if not parts:
            continue
        kind = parts[0]
        if kind not in ("some", "full"):
            raise ValueError(f"unexpected PSI line {line!r}")
        for field in parts[1:]:
            k, sep, v = field.partition("=")
            if not sep:
                raise ValueError(f"unexpected PSI field {field!r}")
            if k in ("avg10", "avg60", "avg300"):
                out[f"{kind}_{k}"] = float(v)
            elif k == "total":
                out[f"{kind}_total_us"] = int(v)
    return out


def read_psi(resource: str = "memory", root: str = "/proc/pressure") -> dict[str, Any]:
    try:
        return parse_psi(Path(root, resource).read_text())
    except FileNotFoundError:
        return {"reason": f"{root}/{resource} not present (kernel without PSI)"}
    except (OSError, ValueError) as exc:
        return {"reason": f"cannot read {root}/{resource}: {exc}"}


def cpu() -> dict[str, Any]:
    per_core = psutil.cpu_percent(percpu=True)
    return {
        "count": psutil.cpu_count(logical=True),
        "percent": round(sum(per_core) / max(1, len(per_core)), 1),
        "per_core": per_core,
        "load": [round(x, 2) for x in os.getloadavg()],
        "psi": read_psi("cpu"),
    }


def memory(promised_bytes: int = 0, reserved_unused_bytes: int = 0) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "total_bytes": int(vm.total),
        "available_bytes": int(vm.available),
        "used_bytes": int(vm.total - vm.available),
        "psi": read_psi("memory"),
        "promised_bytes": int(promised_bytes),
        "reserved_unused_bytes": int(reserved_unused_bytes),
    }


def rdma_devices(sys_root: str = "/sys/class/infiniband") -> dict[str, Any]:
    """RDMA devices from pyverbs when installed, else from sysfs; an empty list says why."""
    try:
        import pyverbs.device as pvd  # Debian python3-pyverbs

        devs = []
        for d in pvd.get_device_list():
            name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
            devs.append({"name": name, "source": "pyverbs", "guid": getattr(d, "guid", None)})
        if devs:
            return {"devices": devs, "reason": None}
        reason = "pyverbs found no RDMA device"
    except ImportError:
        reason = None
    except Exception as exc:  # noqa: BLE001 - libibverbs without a provider raises here
        reason = f"pyverbs failed: {exc}"
    root = Path(sys_root)
    if root.is_dir():
        devs = []
        for d in sorted(root.iterdir()):
            ports = []
            for p in sorted((d / "ports").glob("*")) if (d / "ports").is_dir() else []:
                state = _read(p / "state")
                rate = _read(p / "rate")
                ports.append({"port": p.name, "state": state, "rate": rate})
            devs.append({"name": d.name, "source": "sysfs", "ports": ports})
        if devs:
            return {"devices": devs, "reason": None}
        return {"devices": [], "reason": reason or f"{sys_root} is empty: no RDMA device"}
    return {"devices": [], "reason": reason or f"{sys_root} does not exist: no RDMA device or driver"}


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def now() -> float:
    return time.time()
