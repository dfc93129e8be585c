"""One API server process's lifecycle: STARTING -> SERVING -> DRAINING -> STOPPED (`state.ServerState`).

- STARTING: the app's cleanup contexts run (register with the coordinator, retrying until it answers).
- SERVING: the HTTP port is bound with SO_REUSEPORT, so several frontend processes share it; the ready file is
  written once this frontend follows the coordinator's broadcasts and every expected rank serves.
- DRAINING (`stop(drain=True)`): the port stays open so that a load balancer sees `/health` answer 503 (and
  stops sending) instead of refused connections; new requests get 503 with Retry-After; requests in flight run
  for up to --shutdown-timeout, then end with an error (a stream: an error event, then [DONE]; otherwise a 503
  with Retry-After) and are aborted on their engines (`EnginePool.fail_all`). Then the port closes and the
  handlers get HANDLER_GRACE_S to write their last bytes. A stop while STARTING cancels the registration instead.
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
from dpserve_frontend.errors import OpenAIErrorServer
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import ServerState

log = logging.getLogger("dpserve_frontend")

WAITING_NOTE_S = 10.0  # "waiting for N ranks" this often until every expected rank serves
HANDLER_GRACE_S = 5.0  # after the drain: how long handlers may still write (their requests have ended) before cancel
DRAIN_POLL_S = 0.05


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
        runner = _AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=HANDLER_GRACE_S, access_log=None,
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
        await self._drain(settings.shutdown_timeout_s)
        await runner.cleanup()
        self._state.server_state = ServerState.STOPPED
        log.info("frontend %s stopped", settings.frontend_id)

    async def _drain(self, timeout_s: float) -> None:
        """DRAINING with the port open: wait until no request is in flight on an engine, for at most `timeout_s`;
        then end what is left."""
        pool = self._state.pool
        log.info("draining: /health and new requests answer 503; %d sequences in flight may finish for %.0f s",
                 pool.num_in_flight, timeout_s)
        deadline = time.monotonic() + timeout_s
        while pool.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if pool.num_in_flight:
            num_ended = pool.fail_all(
                "shutting_down",
                f"the server is shutting down and this request did not finish within --shutdown-timeout "
                f"({timeout_s:g} s); retry on another server or later",
            )
            log.warning("--shutdown-timeout (%g s) ran out: ended %d sequences still in flight", timeout_s, num_ended)
        else:
            log.info("drained: no request in flight")

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


class _AppRunner(web.AppRunner):
    """web.AppRunner whose connections answer a request aiohttp's parser refused with an OpenAI error object
    (errors.OpenAIErrorServer); everything else is aiohttp's."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = OpenAIErrorServer  # the same server; its connections get OpenAIErrorRequestHandler
        return server
