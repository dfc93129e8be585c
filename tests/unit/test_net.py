"""free_port: a port that a later bind finds free, out of the way of the kernel's own picks."""

import socket

import pytest

from dpserve_shared.net import LOWEST_PICKED_PORT, ephemeral_port_range, free_port

pytestmark = pytest.mark.timeout(30)


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low, high = ephemeral_port_range()
    assert 0 < low <= high < 65536
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)  # two calls in a row never name the same port
    if low - LOWEST_PICKED_PORT >= 1000:  # room below the range (Linux's default 32768-60999)
        assert all(LOWEST_PICKED_PORT <= port < low for port in ports), ports
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))

