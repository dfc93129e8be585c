"""The API server's lifecycle (in process, no coordinator): STARTING -> SERVING -> DRAINING -> STOPPED, and a
stop that is idempotent, also while it is still registering."""

import asyncio
import socket

import pytest

from dpserve_frontend.server import ApiServer
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import ServerState
from tests.integration._frontend_helpers import run

pytestmark = pytest.mark.timeout(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for_state(server: ApiServer, state: ServerState) -> None:
    for _ in range(500):
        if server.state is state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still {server.state}, not {state}")


def test_serves_then_drains_once_and_stops():
    async def scenario():
        server = ApiServer(FrontendSettings(frontend_id="fe-life", host="127.0.0.1", port=free_port(),
                                            stats_interval_s=0))
        assert server.state is ServerState.STARTING
        running = asyncio.ensure_future(server.run())
        await wait_for_state(server, ServerState.SERVING)
        server.stop()
        server.stop()  # idempotent
        assert server.state is ServerState.DRAINING
        await asyncio.wait_for(running, 10)
        assert server.state is ServerState.STOPPED
        server.stop()
        assert server.state is ServerState.STOPPED

    run(scenario())


def test_stop_while_registering_cancels_the_registration():
    async def scenario():
        nobody = f"tcp://127.0.0.1:{free_port()}"  # no coordinator answers: registration retries
        server = ApiServer(FrontendSettings(coordinator_addr=nobody, frontend_id="fe-early", host="127.0.0.1",
                                            port=free_port(), stats_interval_s=0))
        running = asyncio.ensure_future(server.run())
        await asyncio.sleep(0.2)
        assert server.state is ServerState.STARTING
        server.stop()
        await asyncio.wait_for(running, 10)
        assert server.state is ServerState.STOPPED

    run(scenario())
