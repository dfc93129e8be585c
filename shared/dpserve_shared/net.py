"""Small network helpers shared by the services, `dpserve` and the tests."""

from __future__ import annotations

import random
import socket
import threading

LOWEST_PICKED_PORT = 20000  # above Ray's default worker ports (10002-19999) and the well-known services
_RECENT = 256  # ports handed out lately in this process, not handed out again
_random = random.SystemRandom()  # not the `random` a test may have seeded: two processes must not pick alike
_lock = threading.Lock()
_given: list[int] = []


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for bind(0) and for the local end of outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now; whoever binds it later may still find it taken meanwhile. Picked below the
    kernel's ephemeral range where there is room: a port that bind(0) hands out comes from the range the kernel also
    uses for the local end of every process's outgoing connections, so any connection made meanwhile can take it;
    below that range only an explicit bind can."""
    low, _ = ephemeral_port_range()
    tries = 200 if low - LOWEST_PICKED_PORT >= 1000 else 0  # no room below the range: the kernel's pick
    with _lock:
        picks = (_random.randrange(LOWEST_PICKED_PORT, low) for _ in range(tries))
        port = next((p for p in picks if p not in _given and _bindable(host, p)), None) or _os_pick(host)
        _given.append(port)
        del _given[:-_RECENT]
        return port


def _os_pick(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def has_input(sock) -> bool:
    """Whether messages wait on a zmq.asyncio socket, asked without taking the wake-up from its pending recv.

    Reading ZMQ_EVENTS resets the socket's edge-triggered FD. zmq.asyncio's `get(EVENTS)` then schedules the
    waiting recv itself; `getsockopt(EVENTS)` (an alias of the base class's get) does not, and a message that came
    while the event loop was busy would wait for the next one to wake its reader (a reply that never comes)."""
    import zmq

    return bool(sock.get(zmq.EVENTS) & zmq.POLLIN)
