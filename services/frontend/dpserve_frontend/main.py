"""`dpserve-frontend`: one OpenAI API server process.

Lifecycle: starting (register with the coordinator, retrying until it answers) -> ready (HTTP port bound with
SO_REUSEPORT, so several frontend processes share it) -> draining (first SIGTERM/SIGINT: the port is closed,
new requests on open connections get 503, in-flight requests run for up to --drain-timeout and are then
aborted on their engines) -> stopped (Unregister sent, sockets closed). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import uvloop
from aiohttp import web

from dpserve_frontend.app import COORDINATOR_KEY, STATE_KEY, init_app
from dpserve_frontend.settings import FrontendSettings, settings_from_args

log = logging.getLogger("dpserve_frontend")


async def serve(settings: FrontendSettings) -> None:
    app = init_app(settings)
    state = app[STATE_KEY]
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=settings.drain_timeout_s, access_log=None,
        handle_signals=False,
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    num_signals = 0

    def on_signal(signum: int) -> None:
        nonlocal num_signals
        num_signals += 1
        if num_signals > 1:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("%s: draining", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    setup = loop.create_task(runner.setup())  # registers with the coordinator (may wait for it)
    await asyncio.wait([setup, loop.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not setup.done():
        setup.cancel()
        await asyncio.gather(setup, return_exceptions=True)
        await runner.cleanup()
        return
    setup.result()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_port=True)
    await site.start()
    log.info("frontend %s listening on http://%s:%d", settings.frontend_id, settings.host, settings.port)
    ready = loop.create_task(_write_ready_file(app, settings.ready_file)) if settings.ready_file else None
    await stop.wait()
    if ready is not None:
        ready.cancel()
    state.is_draining = True
    log.info("draining %d in-flight requests (at most %.0f s)", state.num_http_in_flight, settings.drain_timeout_s)
    await runner.cleanup()
    log.info("frontend %s stopped", settings.frontend_id)


async def _write_ready_file(app, path: str) -> None:
    """Writes `path` once this frontend follows the coordinator's broadcasts and every expected rank serves,
    so `dpserve serve` can tell when all of its API servers (which share one port) are ready."""
    state = app[STATE_KEY]
    client = app.get(COORDINATOR_KEY)
    if client is not None:
        await client.follows_broadcasts.wait()
    while state.health()[0] != "ok":
        await asyncio.sleep(0.05)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(state.settings.frontend_id)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    settings = settings_from_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s frontend[{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    log.debug("settings: %s", settings)  # the API key is excluded from the repr
    uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
