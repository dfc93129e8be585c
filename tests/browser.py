"""Headless Chromium driven over the DevTools protocol (a websocket; aiohttp is already a dependency), for the
status page's browser test and for README screenshots.

    async with Browser() as page:
        await page.goto("http://127.0.0.1:8000/status")
        await page.wait_for("document.querySelectorAll('.card').length === 2", timeout_s=20)
        await page.screenshot("status.png")

`find_chromium()` is None where no Chromium is installed (Debian's package: `apt-get install chromium`).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading

import aiohttp

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
# Without the background-networking flags Chromium keeps trying to reach Google's hosts (refused here).
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1")  # fmt: skip
_LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


def find_chromium() -> str | None:
    explicit = os.environ.get("DPSERVE_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for path in map(shutil.which, _CANDIDATES) if path), None)


class BrowserError(Exception):
    pass


class Browser:
    """One Chromium process and one page of it."""

    def __init__(self, executable: str | None = None, width: int = 1280, height: int = 900):
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserError("no Chromium found (install Debian's `chromium` package)")
        self.width, self.height = width, height
        self._profile = tempfile.mkdtemp(prefix="dpserve-chromium-")
        self._proc: subprocess.Popen | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._drain: threading.Thread | None = None  # reads Chromium's stderr once its address is known
        self.console: list[str] = []  # the page's console messages and uncaught errors

    async def __aenter__(self) -> Browser:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _start(self) -> None:
        self._proc = subprocess.Popen(
            [self.executable, *_FLAGS, f"--user-data-dir={self._profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        browser_ws = await asyncio.wait_for(asyncio.to_thread(self._read_ws_address), 30)
        port = int(browser_ws.split(":")[2].split("/")[0])
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = await self._http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)  # fmt: skip

    def _read_ws_address(self) -> str:
        assert self._proc is not None and self._proc.stderr is not None
        seen = b""
        for line in self._proc.stderr:
            seen += line
            match = _LISTENING.search(line)
            if match:
                # Keep draining stderr so that Chromium never blocks on a full pipe.
                stream = self._proc.stderr
                self._drain = threading.Thread(target=lambda: [None for _ in stream], name="chromium-stderr",
                                               daemon=True)
                self._drain.start()
                return match.group(1).decode()
        raise BrowserError(f"Chromium exited before it listened: {seen[-2000:].decode(errors='replace')}")

    async def _read_loop(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = message.json()
            future = self._pending.pop(data.get("id"), None)
            if future is not None and not future.done():
                if "error" in data:
                    future.set_exception(BrowserError(f"{data['error']}"))
                else:
                    future.set_result(data.get("result", {}))
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append(f"uncaught: {data['params']['exceptionDetails'].get('text', '')} "
                                    f"{data['params']['exceptionDetails'].get('exception', {}).get('description', '')}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(BrowserError("the DevTools connection closed"))

    async def send(self, method: str, **params) -> dict:
        if self._ws is None:
            raise BrowserError("not connected")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        return await asyncio.wait_for(future, 30)

    async def goto(self, url: str, timeout_s: float = 20.0) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", timeout_s, what=f"{url} to load")

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float, what: str | None = None, interval_s: float = 0.1):
        """Evaluate `expression` until it is truthy (returned); BrowserError naming `what` after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        value = None
        while loop.time() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(interval_s)
        raise BrowserError(f"timed out after {timeout_s:.0f} s waiting for {what or expression} (last: {value!r})")

    async def screenshot(self, path: str) -> str:
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(result["data"]))
        return path

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # Chromium's renderers and helpers too
            except ProcessLookupError:
                pass
            await asyncio.to_thread(self._proc.wait)
        if self._proc is not None and self._proc.stderr is not None:
            if self._drain is not None:  # at the pipe's end now that Chromium is gone
                await asyncio.to_thread(self._drain.join, 10)
            self._proc.stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)


async def _screenshot(url: str, path: str, wait_s: float, width: int, height: int) -> None:
    async with Browser(width=width, height=height) as page:
        await page.goto(url)
        await asyncio.sleep(wait_s)
        print(await page.screenshot(path))


if __name__ == "__main__":  # python -m tests.browser URL OUT.png [--wait-s S]: the README's screenshot
    import argparse

    parser = argparse.ArgumentParser("python -m tests.browser", description="screenshot a page in headless Chromium")
    parser.add_argument("url")
    parser.add_argument("output")
    parser.add_argument("--wait-s", type=float, default=5.0, help="seconds on the page before the shot")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args()
    asyncio.run(_screenshot(args.url, args.output, args.wait_s, args.width, args.height))
