"""bench/report.idle_settings and bench paging's note on how the machine wakes idle vCPUs."""

from __future__ import annotations

from pathlib import Path

from bench import paging, report


def test_idle_settings_read_the_cpu_flags_the_driver_and_the_polling_time(monkeypatch):
    files = {"/proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu vme hypervisor lahf_lm\n",
             "/sys/devices/system/cpu/cpuidle/current_driver": "haltpoll\n",
             "/sys/module/haltpoll/parameters/guest_halt_poll_ns": "200000\n"}
    real_read = Path.read_text

    def fake_read(self, *a, **k):
        if str(self) in files:
            return files[str(self)]
        if str(self).startswith(("/sys/", "/proc/")):
            raise FileNotFoundError(str(self))
        return real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", fake_read)
    assert report.idle_settings() == {"virtual": True, "cpuidle_driver": "haltpoll", "guest_halt_poll_ns": 200000}
    files["/proc/cpuinfo"] = "flags\t\t: fpu vme lahf_lm\n"  # bare metal
    del files["/sys/module/haltpoll/parameters/guest_halt_poll_ns"]  # no haltpoll module
    files["/sys/devices/system/cpu/cpuidle/current_driver"] = "intel_idle\n"
    assert report.idle_settings() == {"virtual": False, "cpuidle_driver": "intel_idle", "guest_halt_poll_ns": None}
    files["/proc/cpuinfo"] = "model name\t: Some CPU\nflags\t\t: fpu hypervisor\n"
    m = report.machine()
    assert m["cpu_model"] == "Some CPU" and m["idle"]["virtual"] is True


def test_paging_notes_a_virtual_machine_that_does_not_poll_before_halting():
    assert paging.halt_polling_note({"virtual": False, "cpuidle_driver": "intel_idle", "guest_halt_poll_ns": None}) is None
    assert paging.halt_polling_note({"virtual": True, "cpuidle_driver": "haltpoll", "guest_halt_poll_ns": 200000}) is None
    off = paging.halt_polling_note({"virtual": True, "cpuidle_driver": "haltpoll", "guest_halt_poll_ns": 0})
    assert off and "guest_halt_poll_ns = 0" in off
    none = paging.halt_polling_note({"virtual": True, "cpuidle_driver": "acpi_idle", "guest_halt_poll_ns": None})
    assert none and "cpuidle driver acpi_idle" in none
