"""`dpserve-frontend`: one OpenAI API server process (its lifecycle: `server.ApiServer`).

The first SIGTERM/SIGINT drains (`ApiServer.stop(drain=True)`); a second one exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import uvloop
from aiohttp.http_exceptions import HttpProcessingError

from dpserve_shared.zmq_security import log_security

from dpserve_frontend.server import ApiServer
from dpserve_frontend.settings import FrontendSettings, settings_from_args
from dpserve_frontend.state import ServerState

log = logging.getLogger("dpserve_frontend")


async def serve(settings: FrontendSettings) -> None:
    server = ApiServer(settings)

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if server.state in (ServerState.STARTING, ServerState.SERVING):
            log.info("%s: draining", name)
            server.stop(drain=True)
        else:
            log.warning("second %s: exiting now", name)
            server.stop(drain=False, exit_code=128 + signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await server.run()


def _unparsable_requests_at_debug(record: logging.LogRecord) -> bool:
    """aiohttp logs every request it cannot parse (garbage or TLS on the HTTP port, a header over its limits) as an
    ERROR with a traceback, so any client could fill the log; the client gets its 400, the log gets nothing
    (unless --log-level debug)."""
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, HttpProcessingError) or logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def main(argv: list[str] | None = None) -> None:
    settings = settings_from_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s frontend[{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(_unparsable_requests_at_debug)
    log.debug("settings: %s", settings)  # the API key and the cluster key are excluded from the repr
    log_security(log, settings.zmq_security)
    uvloop.run(serve(settings))


if __name__ == "__main__":
    main()
