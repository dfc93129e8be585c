"""Small network helpers shared by the services, `dpserve` and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick; whoever binds it later may find it taken meanwhile)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
