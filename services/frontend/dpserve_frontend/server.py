"""One API server process's lifecycle: STARTING -> SERVING -> DRAINING -> STOPPED (`state.ServerState`).

- STARTING: the app's cleanup contexts run (register with the coordinator, retrying until it answers).
- SERVING: the HTTP port is bound with SO_REUSEPORT, so several frontend processes share it; the ready file is
  written once this frontend follows the coordinator's broadcasts and every expected rank serves.
- DRAINING (`stop(drain=True)`): the port is closed, new requests on open connections get 503, in-flight
  requests run for up to the drain timeout and are then aborted on their engines. A stop while STARTING cancels
  the registration instead.
- STOPPED: engines disconnected, Unregister sent; `run` returns.

`stop(drain=False)` exits the process at once (a second signal): nothing is left to save, and the coordinator
notices the silence.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from aiohttp import web

from dpserve_frontend.app import COORDINATOR_KEY, STATE_KEY, init_app, server_options
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import ServerState

log = logging.getLogger("dpserve_frontend")

WAITING_NOTE_S = 10.0  # "waiting for N ranks" this often until every expected rank serves


class ApiServer:
    def __init__(self, settings: FrontendSettings):
        self.settings = settings
        self.app = init_app(settings)
        self._state = self.app[STATE_KEY]
        self._stop_asked = asyncio.Event()

    @property
    def state(self) -> ServerState:
        return self._state.server_state

    def stop(self, drain: bool = True, exit_code: int = 1) -> None:
        """The one way out, idempotent. With `drain`, `run` drains and returns; without it the process exits
        now with `exit_code`."""
        if not drain:
            os._exit(exit_code)
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            return
        self._state.server_state = ServerState.DRAINING
        self._stop_asked.set()

    async def run(self) -> None:
        settings = self.settings
        runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=settings.drain_timeout_s, access_log=None,
            handle_signals=False, **server_options(settings),
        )
        loop = asyncio.get_running_loop()
        setup = loop.create_task(runner.setup())  # registers with the coordinator (may wait for it)
        stop_asked = loop.create_task(self._stop_asked.wait())
        await asyncio.wait([setup, stop_asked], return_when=asyncio.FIRST_COMPLETED)
        if not setup.done():
            setup.cancel()
            await asyncio.gather(setup, return_exceptions=True)
            await runner.cleanup()
            self._state.server_state = ServerState.STOPPED
            return
        setup.result()
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=True)
        await site.start()
        if self.state is ServerState.STARTING:  # not if a stop came meanwhile
            self._state.server_state = ServerState.SERVING
        log.info("frontend %s listening on http://%s:%d", settings.frontend_id, settings.host, settings.port)
        ready = loop.create_task(self._wait_for_ranks(settings.ready_file))
        await stop_asked
        if ready is not None:
            ready.cancel()
        log.info("draining %d in-flight requests (at most %.0f s)", self._state.num_http_in_flight,
                 settings.drain_timeout_s)
        await runner.cleanup()
        self._state.server_state = ServerState.STOPPED
        log.info("frontend %s stopped", settings.frontend_id)

    async def _wait_for_ranks(self, path: str | None) -> None:
        """Until this frontend follows the coordinator's broadcasts and every expected rank serves, says so every
        WAITING_NOTE_S ("waiting for N ranks"); then writes `path` (--ready-file), so `dpserve serve` can tell
        when all of its API servers (which share one port) are ready."""
        state = self._state
        client = self.app.get(COORDINATOR_KEY)
        next_note = time.monotonic()
        while not ((client is None or client.follows_broadcasts.is_set()) and state.health()[0] == "ok"):
            if time.monotonic() >= next_note:
                _, serving, expected = state.health()
                log.info("waiting for %d rank(s) to serve (%d serving)", max(expected, 1), len(serving))
                next_note = time.monotonic() + WAITING_NOTE_S
            await asyncio.sleep(0.05)
        _, serving, _ = state.health()
        log.info("all %d rank(s) serving", len(serving))
        if path is None:
            return
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(state.settings.frontend_id)
        os.replace(tmp, path)
