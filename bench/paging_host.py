"""The host controls ``dlshare bench paging`` (and ``bench cache``) run their programs under: a
cgroup v1 memory limit for one program, a swapfile on for the swap baseline only, the kernel's swap
counters, and what a 4 KiB read from the local disk costs.  I/O only: no figure is computed here."""

from __future__ import annotations

import mmap
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.memory import _pcts

MIB = 1 << 20


# --- a memory cgroup for one process -------------------------------------------------------------

class MemoryLimit:
    """A cgroup v1 memory group for one program: created empty, the child joins it before it
    executes, the limit is set once the program says how big it is without its working set."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str) -> None:
        if not (self.ROOT / "memory.limit_in_bytes").exists():
            raise RuntimeError("needs the cgroup v1 memory controller at /sys/fs/cgroup/memory (this bench "
                               "drives v1, as the development machines mount it)")
        own = "/"
        for line in open("/proc/self/cgroup"):
            parts = line.strip().split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                own = parts[2]
        self.path = self.ROOT / own.lstrip("/") / "dlshare-bench" / name
        self.path.mkdir(parents=True, exist_ok=True)

    def join(self) -> None:
        """For preexec_fn: the child moves itself in before it executes the program."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def limit(self, nbytes: int, swap: bool) -> None:
        memsw = self.path / "memory.memsw.limit_in_bytes"
        (self.path / "memory.limit_in_bytes").write_text(str(nbytes))
        if memsw.exists():  # swap allowed only for the swap baseline
            memsw.write_text("-1" if swap else str(nbytes))

    def usage(self) -> int:
        """Bytes charged to the group now: what the limit counts (RSS also counts shared library
        pages that other processes brought in, which this group is never charged for)."""
        return int((self.path / "memory.usage_in_bytes").read_text())

    def stats(self) -> dict[str, int]:
        out = {}
        for f, k in (("memory.max_usage_in_bytes", "max_usage_bytes"), ("memory.failcnt", "failcnt"),
                     ("memory.memsw.max_usage_in_bytes", "max_usage_with_swap_bytes")):
            try:
                out[k] = int((self.path / f).read_text())
            except OSError:
                pass
        try:
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        except (OSError, ValueError):
            pass
        return out

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the exited process is still being torn down


def disk_read_latency(directory: Path, nbytes: int = 64 * MIB, n: int = 2000) -> dict[str, float]:
    """4 KiB O_DIRECT random reads of a file on the disk the swapfile and memmap use: what a page-in
    from that disk costs here (a virtual disk served from the host's page cache is far faster than
    a real SSD)."""
    path = directory / "disk-probe.bin"
    buf = np.frombuffer(os.urandom(MIB), np.uint8)
    with open(path, "wb") as fh:
        for _ in range(nbytes // MIB):
            fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        page = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
        rng = np.random.default_rng(6)
        lat = np.empty(n, np.int64)
        for i, blk in enumerate(rng.integers(0, nbytes // 4096, n)):
            t = time.perf_counter_ns()
            os.preadv(fd, [page], int(blk) * 4096)
            lat[i] = time.perf_counter_ns() - t
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    p50, p99 = _pcts(lat)
    return {"disk_read_4k_p50_us": p50, "disk_read_4k_p99_us": p99}


class Swapfile:
    """A swapfile on the local disk, on for the swap baseline only."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        self.path = directory / "dlshare-bench.swap"
        self.nbytes = nbytes
        self.on = False

    def __enter__(self) -> "Swapfile":
        try:
            subprocess.run(["fallocate", "-l", str(self.nbytes), str(self.path)], check=True, capture_output=True)
            os.chmod(self.path, 0o600)
            subprocess.run(["mkswap", str(self.path)], check=True, capture_output=True)
            subprocess.run(["swapon", str(self.path)], check=True, capture_output=True, text=True)
            self.on = True
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            err = getattr(exc, "stderr", b"") or b""
            raise RuntimeError(f"swap refused: {(err.decode() if isinstance(err, bytes) else err).strip() or exc}") \
                from None
        return self

    def close(self) -> None:
        if self.on:
            subprocess.run(["swapoff", str(self.path)], capture_output=True)
            self.on = False
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.close()


def vmstat() -> dict[str, int]:
    """The kernel's swap counters (pages swapped in and out since boot)."""
    out = {}
    try:
        for line in open("/proc/vmstat"):
            k, _, v = line.partition(" ")
            if k in ("pswpin", "pswpout"):
                out[k] = int(v)
    except OSError:
        pass
    return out
