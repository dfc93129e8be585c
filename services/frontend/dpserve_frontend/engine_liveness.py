"""Ageing the topology while the coordinator is away: a rank that stops answering is dropped all the same.

The coordinator tells the frontends which ranks died. While it is gone (restarting: the broadcast has been silent
for COORDINATOR_SILENCE_S), a frontend watches its own connections instead: each engine DEALER sends ZMTP
heartbeats (PING every HEARTBEAT_IVL_MS, answered by the engine's I/O thread even during a long step), so an
engine that died (its TCP connection closes) or stopped (no PONG within HEARTBEAT_TIMEOUT_MS) shows up as a
disconnect on the socket's monitor. A rank disconnected for UNREACHABLE_S while the coordinator is away is
dropped (its requests move to the other ranks); with the coordinator there, its word counts (it marks the rank
DEAD and replaces it), and a connection that comes back in time changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
UNREACHABLE_S = 2.0  # disconnected this long (after the heartbeat timeout) while the coordinator is away: drop it
_CHECK_S = 0.5


def enable_heartbeats(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


async def watch_connection(
    socket: zmq.asyncio.Socket,
    is_coordinator_away: Callable[[], bool],
    on_unreachable: Callable[[str], None],
) -> None:
    """Until cancelled, or until it calls `on_unreachable(reason)` once: the socket's connect/disconnect events."""
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    disconnected_since: float | None = None
    try:
        while True:
            if await monitor.poll(int(_CHECK_S * 1000)):
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    disconnected_since = disconnected_since or time.monotonic()
                elif event == zmq.EVENT_CONNECTED:
                    disconnected_since = None
            if (disconnected_since is not None and time.monotonic() - disconnected_since > UNREACHABLE_S
                    and is_coordinator_away()):
                on_unreachable(f"not answering for {time.monotonic() - disconnected_since:.0f} s while the "
                               "coordinator is away")  # fmt: skip
                return
    finally:
        stop_watching(socket)
        monitor.close(linger=0)


def stop_watching(socket: zmq.Socket) -> None:
    """End the socket's monitor. Call it before closing the socket: a monitor still on when the socket closes
    sends its DISCONNECTED event from the context's I/O thread to a monitor socket nobody reads any more, and that
    send blocks the I/O thread for good (libzmq issue 3575): every socket of the context, so every engine
    connection of this API server, stops moving. Seen in the tests as a request that never reached its engine."""
    if socket.closed:
        return
    try:
        socket.disable_monitor()
    except zmq.ZMQError:
        pass  # never monitored, or its monitor ended already
