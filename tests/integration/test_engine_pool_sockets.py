"""An API server's engine connections survive ranks coming and going: each engine DEALER carries a monitor
(engine_liveness.py), and a monitor left on when its socket closed could block the ZMQ context's I/O thread for
good (libzmq issue 3575), after which no engine connection of that API server moved again. In the suite it showed
as a request that never reached its engine, some tens of frontends into a test module on a busy machine.

The hang needs the I/O thread to emit a monitor event after the reader closed, a race; the sequence below (connect,
a rank dropped or the pool closed, the engine gone) lost it within the first two cycles of every run on the code
before the fix (the monitor was stopped after the socket closed, which does nothing)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import zmq
import zmq.asyncio

from dpserve_frontend.engine_pool import EnginePool
from dpserve_shared.schema import EngineInfo, EngineState, Topology
from dpserve_shared.zmq_security import ZmqSecurity

pytestmark = pytest.mark.timeout(60)

CYCLES = 30


def _engine(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    ZmqSecurity.from_environment().server(router, "engine socket")
    return router, f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"


async def _probe(pool: EnginePool, rank: int, router: zmq.Socket, cycle: int) -> None:
    """A message from the pool's connection to `rank` reaches its engine within 5 s."""
    await pool._engines[rank].socket.send(b"probe")
    for _ in range(500):
        if router.poll(0):
            assert router.recv_multipart()[-1] == b"probe"
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"cycle {cycle}: a message to rank {rank} never reached its engine (the context is stuck)")


async def _scenario() -> None:
    engines_ctx = zmq.Context()
    pool_ctx = zmq.asyncio.Context()
    try:
        epoch = 0
        for cycle in range(CYCLES):
            pool = EnginePool(f"fe-test-{uuid.uuid4().hex[:8]}", context=pool_ctx)
            router, addr = _engine(engines_ctx)
            epoch += 1
            pool.apply_topology(Topology(epoch, [EngineInfo(0, f"engine-{cycle}", addr, EngineState.READY)]))
            await _probe(pool, 0, router, cycle)
            if cycle % 2:
                epoch += 1  # the rank dies: the pool drops it
                pool.apply_topology(Topology(epoch, [EngineInfo(0, f"engine-{cycle}", addr, EngineState.DEAD)]))
            else:
                await pool.close()  # the API server stops
            await asyncio.sleep(0)  # the watch task's cancellation runs
            router.close(0)  # then the engine goes: its peers see a disconnect
            await asyncio.sleep(0.01)
            if cycle % 2:
                await pool.close()
    finally:
        pool_ctx.destroy(0)
        engines_ctx.destroy(0)


def test_engine_connections_keep_working_after_ranks_come_and_go():
    asyncio.run(asyncio.wait_for(_scenario(), 50))
