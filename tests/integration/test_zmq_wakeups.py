"""Asking a zmq.asyncio socket whether input waits must not take the wake-up from its pending recv (the coordinator's
publish loop asks its control socket each tick): a message that came while the loop was busy is still received."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from dpserve_shared.net import has_input

pytestmark = pytest.mark.timeout(30)


async def _message_after_a_busy_loop(ask) -> list[bytes] | None:
    ctx, sync = zmq.asyncio.Context(), zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = sync.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        pending = asyncio.ensure_future(router.recv_multipart())
        await asyncio.sleep(0.2)  # connected; the recv waits on the socket's FD
        dealer.send(b"ping")
        time.sleep(0.2)  # it arrives while the loop is busy, before the loop polls the FD again
        ask(router)
        try:
            return await asyncio.wait_for(pending, 3)
        except TimeoutError:
            return None
    finally:
        ctx.destroy(0)
        sync.destroy(0)


def test_has_input_leaves_the_wake_up_to_the_pending_recv():
    got = asyncio.run(_message_after_a_busy_loop(has_input))
    assert got is not None and got[-1] == b"ping"


def test_the_hazard_is_real_getsockopt_events_loses_the_wake_up():
    """What the coordinator did before: the recv stays asleep with the message waiting (so the test above can fail)."""
    assert asyncio.run(_message_after_a_busy_loop(lambda sock: sock.getsockopt(zmq.EVENTS))) is None
