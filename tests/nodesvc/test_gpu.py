"""GPU telemetry through the NVML interface (nodesvc.gpu): the real pynvml path and the simulated one."""

import pytest

from nodesvc.gpu import GpuProbe, SimulatedNvml


def test_gpu_probe_without_nvml_library_says_why():
    g = GpuProbe()  # the real pynvml path; this machine has no NVIDIA driver
    s = g.sample()
    if s["devices"]:
        pytest.skip("this machine has a GPU")  # the GPU machine: covered by test_gpu_probe_simulated
    assert s["reason"] and ("NVML" in s["reason"] or "pynvml" in s["reason"])


def test_gpu_probe_broken_init_reports_reason():
    class Broken(SimulatedNvml):
        def nvmlInit(self):
            raise RuntimeError("Driver Not Loaded")

    s = GpuProbe(Broken(2)).sample()
    assert s["devices"] == [] and "Driver Not Loaded" in s["reason"]


def test_gpu_probe_reads_every_field_through_the_nvml_interface():
    load = {0: (80.0, [111]), 1: (0.0, [])}
    s = GpuProbe(SimulatedNvml(2, memory_bytes=32 << 30, load=lambda i: load[i])).sample()
    d0, d1 = s["devices"]
    assert s["simulated"] is True and s["reason"] is None
    assert d0["util_percent"] == 80 and d1["util_percent"] == 0
    assert d0["memory_total_bytes"] == 32 << 30 and d0["memory_used_bytes"] > 0
    assert d0["processes"] == [{"pid": 111, "memory_used_bytes": 2 << 30}]
    assert d0["power_w"] > d1["power_w"] and d0["sm_clock_mhz"] > 0


def test_gpu_probe_tolerates_unsupported_fields():
    class Partial(SimulatedNvml):
        def nvmlDeviceGetPowerUsage(self, h):
            raise RuntimeError("Not Supported")

    d = GpuProbe(Partial(1)).sample()["devices"][0]
    assert d["power_w"] is None and d["util_percent"] == 0
