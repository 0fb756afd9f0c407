"""Real headless Chromium driven over the DevTools protocol (CDP), for the status-page tests.

``chromium --dump-dom`` loads a page once; a test that logs in through a form, reads cookies as the
page's script would see them, waits for the page to refresh itself and takes a screenshot needs
the browser itself.  :class:`Chromium` starts Debian's chromium with a DevTools port (it writes the
port to ``DevToolsActivePort`` in its profile directory), :class:`Page` speaks CDP to one tab over
a WebSocket (``websockets``, which amqtt already brings): ``goto``, ``eval``, ``wait_for``,
``screenshot``.  The browser is stopped by its pid, within a bounded time.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import httpx
import websockets

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a closed network, as root: no sandbox, no background traffic, no first-run UI.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


class CdpError(RuntimeError):
    pass


class Page:
    """One tab.  ``eval`` returns the JSON value of an expression (awaiting a promise)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        cid = next(self._ids)
        await self.ws.send(json.dumps({"id": cid, "method": method, "params": params}))

        async def answer() -> dict[str, Any]:
            while True:
                msg = json.loads(await self.ws.recv())
                if msg.get("id") == cid:
                    if "error" in msg:
                        raise CdpError(f"{method}: {msg['error']}")
                    return msg.get("result", {})

        return await asyncio.wait_for(answer(), timeout)

    async def eval(self, expr: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise CdpError(f"{expr[:80]}: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    async def goto(self, url: str, timeout: float = 30.0) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout,
                            f"{url} loaded")

    async def wait_for(self, expr: str, timeout: float = 30.0, what: str = "") -> Any:
        """Poll ``expr`` until it is truthy (a page reloading meanwhile is retried)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: Any = None
        while True:
            try:
                last = await self.eval(expr)
            except CdpError as exc:  # the page navigated away between evaluations
                last = str(exc)
            else:
                if last:
                    return last
            if loop.time() >= deadline:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what or expr!r} (last: {last!r})")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path, width: int = 1400, height: int = 1000, whole: bool = False) -> bytes:
        """A PNG of the viewport (``whole``: of the whole page) at ``width`` x ``height``."""
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        r = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=whole)
        data = base64.b64decode(r["data"])
        path.write_bytes(data)
        return data


class Chromium:
    def __init__(self, tmp: Path) -> None:
        self.profile = tmp / "chromium-profile"
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self._sockets: list[Any] = []
        self._tmpdir: str | None = None

    async def start(self, timeout: float = 30.0) -> "Chromium":
        if CHROMIUM is None:
            raise RuntimeError("chromium is not installed: `make deps` installs Debian's chromium package")
        self.profile.mkdir(parents=True, exist_ok=True)
        active = self.profile / "DevToolsActivePort"
        active.unlink(missing_ok=True)  # a profile used before keeps the port of its last browser
        log = open(self.profile.parent / "chromium.log", "ab")
        # Its singleton socket goes in a TMPDIR of its own, removed by stop(), not a /tmp/org.chromium.*
        # left behind by every run; a short one, since a socket's path must fit in 108 bytes.
        self._tmpdir = tempfile.mkdtemp(prefix="dls-crm-")
        self.proc = await asyncio.create_subprocess_exec(
            CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1", "about:blank", stdout=log, stderr=log,
            env={**os.environ, "TMPDIR": self._tmpdir})
        log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (active.exists() and active.read_text().strip()):
            if self.proc.returncode is not None or loop.time() > deadline:
                raise RuntimeError(f"chromium did not open its DevTools port (see {self.profile.parent}/chromium.log)")
            await asyncio.sleep(0.1)
        self.port = int(active.read_text().split()[0])
        return self

    async def page(self) -> Page:
        """A new tab."""
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.put(f"http://127.0.0.1:{self.port}/json/new?about:blank")
        ws = await websockets.connect(r.json()["webSocketDebuggerUrl"], max_size=None)
        self._sockets.append(ws)
        page = Page(ws)
        await page.call("Page.enable")
        await page.call("Runtime.enable")
        return page

    async def stop(self) -> None:
        for ws in self._sockets:
            try:
                await asyncio.wait_for(ws.close(), 5)
            except Exception:  # noqa: BLE001 - the browser goes away below anyway
                pass
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                await asyncio.wait_for(self.proc.wait(), 10)
            except (ProcessLookupError, TimeoutError):
                try:
                    os.kill(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await asyncio.wait_for(self.proc.wait(), 10)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
