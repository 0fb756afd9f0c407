"""Process, port and address helpers shared by `dlshare up`, the daemons, the benchmarks and the tests."""

from __future__ import annotations

import asyncio
import inspect
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

from nodesvc.bus.config import ConfigError

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the caller should bind it soon)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 20.0,
              host: str = "127.0.0.1") -> None:
    """Wait until something accepts connections on host:port; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def stop_proc(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Signal a child, wait for it, and kill it if it does not exit in time."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def split_hostport(text: str, default_port: int) -> tuple[str, int]:
    """``host:port``, ``host``, ``:port`` or ``[v6]:port`` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":") or str(default_port)
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, str(default_port)
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"listen address {text!r}: port {port!r} is not a number") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"listen address {text!r}: port {p} out of range")
    return host or "127.0.0.1", p


def wait_until(pred: Callable[[], T], timeout: float = 20.0, what: str = "condition",
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``pred`` until it returns something truthy, and return that.

    ``ignore``: exception types that count as "not yet" (the last one is named in
    the error).  Raises :class:`TimeoutError` naming ``what`` after ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = pred()
            if last:
                return last  # type: ignore[return-value]
        except ignore as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


async def until(pred: Callable[[], T], timeout: float = 20.0, what: str = "condition",
                interval: float = 0.05) -> T:
    """:func:`wait_until` for a coroutine: polls ``pred`` between awaits, without blocking the loop.
    ``pred`` may return an awaitable (a coroutine that runs a blocking check in a thread, say)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = pred()
        if inspect.isawaitable(v):
            v = await v
        if v:
            return v
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last: {v!r})")
        await asyncio.sleep(interval)
