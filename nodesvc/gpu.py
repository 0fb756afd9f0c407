"""Per-GPU telemetry through NVML (nvidia-ml-py, imported as ``pynvml``).

:class:`GpuProbe` takes any object with the pynvml function names, so the real
module and :class:`SimulatedNvml` (for nodes without GPUs that are told to
pretend, and for tests) run the same code path.  A node with no GPU or no
NVML library reports an empty device list and the reason; that is not an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

log = logging.getLogger("dlshare.gpu")


class GpuProbe:
    def __init__(self, nvml: Any | None = None) -> None:
        self.reason: str | None = None
        self.nvml = None
        self.simulated = isinstance(nvml, SimulatedNvml)
        if nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                nvml = pynvml
            except ImportError:
                self.reason = "nvidia-ml-py (pynvml) is not installed"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"NVML unavailable: {exc}"
            return
        self.nvml = nvml
        try:
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001 - optional field
            self.driver = None

    def sample(self) -> dict[str, Any]:
        if self.nvml is None:
            return {"devices": [], "reason": self.reason, "simulated": False}
        n = self.nvml
        devices = []
        try:
            count = n.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001
            return {"devices": [], "reason": f"nvmlDeviceGetCount failed: {exc}", "simulated": self.simulated}
        for i in range(count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:  # noqa: BLE001 - a GPU that fell off the bus
                devices.append({"index": i, "error": f"nvmlDeviceGetHandleByIndex failed: {exc}"})
                continue
            d: dict[str, Any] = {"index": i}
            d["name"] = _try(lambda: _text(n.nvmlDeviceGetName(h)))
            d["uuid"] = _try(lambda: _text(n.nvmlDeviceGetUUID(h)))
            util = _try(lambda: n.nvmlDeviceGetUtilizationRates(h))
            d["util_percent"] = getattr(util, "gpu", None)
            d["memory_util_percent"] = getattr(util, "memory", None)
            mem = _try(lambda: n.nvmlDeviceGetMemoryInfo(h))
            d["memory_used_bytes"] = getattr(mem, "used", None)
            d["memory_total_bytes"] = getattr(mem, "total", None)
            d["sm_clock_mhz"] = _try(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            d["mem_clock_mhz"] = _try(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))
            mw = _try(lambda: n.nvmlDeviceGetPowerUsage(h))
            d["power_w"] = None if mw is None else mw / 1000.0
            procs = _try(lambda: n.nvmlDeviceGetComputeRunningProcesses(h)) or []
            d["processes"] = [
                {"pid": p.pid, "memory_used_bytes": getattr(p, "usedGpuMemory", None)} for p in procs
            ]
            devices.append(d)
        return {"devices": devices, "reason": None, "simulated": self.simulated, "driver": self.driver}

    def close(self) -> None:
        if self.nvml is not None:
            _try(self.nvml.nvmlShutdown)


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a field NVML does not support on this device
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SimulatedNvml:
    """A stand-in with pynvml's names, for nodes told to simulate GPUs (``fake_gpus``).

    Utilisation comes from ``load(index) -> (util_percent, [pids])``, which the
    daemon wires to the jobs it runs on that device; telemetry marks the
    devices ``"simulated": true`` so nobody mistakes them for real ones.
    """

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, count: int, memory_bytes: int = 16 << 30, name: str = "Simulated V100",
                 load: Callable[[int], tuple[float, list[int]]] | None = None) -> None:
        self.count = count
        self.memory_bytes = memory_bytes
        self.name = name
        self.load = load or (lambda i: (0.0, []))
        self.initialised = False

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "simulated"

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.name

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-simulated-{h:04d}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        util, _ = self.load(h)
        u = int(max(0.0, min(100.0, util)))
        return SimpleNamespace(gpu=u, memory=u // 2)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        _, pids = self.load(h)
        used = min(self.memory_bytes, len(pids) * (2 << 30))
        return SimpleNamespace(used=used, total=self.memory_bytes, free=self.memory_bytes - used)

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        return 1380 if kind == self.NVML_CLOCK_SM else 877  # V100 boost SM / HBM2 clocks

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        util, _ = self.load(h)
        return int((40 + 2.1 * util) * 1000)  # milliwatts, 40 W idle to 250 W (V100 TDP)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        _, pids = self.load(h)
        return [SimpleNamespace(pid=p, usedGpuMemory=2 << 30) for p in pids]
