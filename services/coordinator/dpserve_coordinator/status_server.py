"""The coordinator's own status page (`--status-port`): the same routes and document as every API server's
(dpserve_shared.status_http), built straight from the registry, so it works with no API server at all. Its
"coordinator" section also says what the coordinator published (server.py's PublishCounts), which only it knows."""

from __future__ import annotations

import logging

from aiohttp import web

from dpserve_shared.status import StatusInputs, StatusTracker
from dpserve_shared.status_http import StatusRoutes

log = logging.getLogger("dpserve.coordinator")

_SHUTDOWN_S = 2.0  # open event streams end within EVENT_INTERVAL_S once closing


class StatusServer:
    def __init__(self, coordinator, host: str, port: int, api_key: str | None):
        self._coordinator = coordinator
        self._host, self._port = host, port
        self._closing = False
        app = web.Application()
        StatusRoutes(StatusTracker("coordinator", self._read), api_key, closing=lambda: self._closing).add_to(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_S)

    def _read(self) -> StatusInputs:
        registry, waves = self._coordinator.registry, self._coordinator.waves
        loads = {rank: entry.load for rank, entry in registry.engines.items() if entry.load is not None}
        return StatusInputs(registry.topology(), loads, waves.wave, waves.running, registry.frontend_stats(), 0.0,
                            coordinator_published=self._coordinator.published.as_dict())

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        host = f"[{self._host}]" if ":" in self._host else self._host
        log.info("status page on http://%s:%d/status", host, self._port)

    async def close(self) -> None:
        self._closing = True
        await self._runner.cleanup()
