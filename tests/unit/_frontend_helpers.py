"""Shared by the frontend's unit tests: the bundled model's ModelInfo (tokenizer data only, no weights)."""

import functools

import pytest


@functools.cache
def load_model_info():
    from dpserve_engine.model_info import load_model_info as load
    from dpserve_engine.settings import EngineConfig

    return load(EngineConfig())


@pytest.fixture(scope="session")
def model_info():
    return load_model_info()


# ---------------------------------------------------------------------------------------------------------------
# An in-process engine for the frontend's tests: the null engine core behind a real ZMQ ROUTER, in a thread.
# ---------------------------------------------------------------------------------------------------------------

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import threading  # noqa: E402

import zmq  # noqa: E402

from dpserve_shared.codec import encode, engine_decoder  # noqa: E402
from dpserve_shared.envelope import frames, split  # noqa: E402
from dpserve_shared.schema import (  # noqa: E402
    AbortRequests,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    EngineState,
    FinishReason,
    RequestOutput,
    Topology,
)


class FakeEngine:
    """Serves EngineRequest/AbortRequests on a ROUTER with NullEngineCore; records what it received."""

    def __init__(self, rank: int, model_info, step_time_s: float = 0.002, token_ids=None):
        from dpserve_engine.null_core import NullEngineCore

        self.rank = rank
        self.core = NullEngineCore(model_info, step_time_s=step_time_s, token_ids=token_ids)
        self.received: list = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.input_addr = f"tcp://127.0.0.1:{port}"
        self._owner: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def info(self, state=EngineState.READY) -> EngineInfo:
        return EngineInfo(self.rank, f"engine-{self.rank}", self.input_addr, state)

    def _run(self):
        decoder = engine_decoder()
        while not self._stop.is_set():
            if self._socket.poll(1 if self.core.has_unfinished() else 20):
                identity, data = self._socket.recv_multipart()
                message = decoder.decode(data)
                self.received.append(message)
                if isinstance(message, EngineRequest):
                    self._owner[message.request_id] = identity
                    try:
                        self.core.add_request(message)
                    except Exception as e:  # InvalidRequest
                        self._send([RequestOutput(message.request_id, finish_reason=FinishReason.ERROR,
                                                  error=str(e))])
                elif isinstance(message, AbortRequests):
                    self._send(self.core.abort(message.request_ids))
                continue
            if self.core.has_unfinished():
                self._send(self.core.step())

    def _send(self, outputs):
        by_owner: dict[bytes, list] = {}
        for output in outputs:
            by_owner.setdefault(self._owner.get(output.request_id, b""), []).append(output)
        for identity, items in by_owner.items():
            load = self.core.load()
            load.rank = self.rank
            self._socket.send_multipart([identity, encode(EngineOutputs(self.rank, items, load=load))])

    def requests(self):
        return [m for m in self.received if isinstance(m, EngineRequest)]

    def aborted_ids(self):
        return [i for m in self.received if isinstance(m, AbortRequests) for i in m.request_ids]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


def topology(engines, epoch=1, model=None, size=None) -> Topology:
    return Topology(epoch, [e.info() if isinstance(e, FakeEngine) else e for e in engines], model,
                    size if size is not None else len(engines))


@contextlib.asynccontextmanager
async def frontend_client(model_info, engines=(), **settings_kwargs):
    """An aiohttp test client for a frontend app with no coordinator, connected to `engines`."""
    from aiohttp.test_utils import TestClient, TestServer

    from dpserve_frontend.app import STATE_KEY, init_app
    from dpserve_frontend.settings import FrontendSettings

    settings = FrontendSettings(frontend_id="fe-test", stats_interval_s=0, **settings_kwargs)
    app = init_app(settings, model_info=model_info)
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    try:
        if engines:
            app[STATE_KEY].apply_topology(topology(engines))
        yield client
    finally:
        await client.close()


def run(coro, timeout_s: float = 30):
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


class FakeCoordinator:
    """A control ROUTER + PUB in a thread: acks frontends with a topology, records what they send, publishes."""

    def __init__(self, model_info, engines=(), port: int | None = None, accept: bool = True):
        from dpserve_shared.codec import coordinator_decoder

        self.model_info = model_info
        self.engines = list(engines)
        self.accept = accept
        self.received: list = []
        self.epoch = 1
        self._decoder = coordinator_decoder()
        # Each fake is a deployment of its own: a frontend started without an id follows a restarted coordinator.
        self.deployment_id = f"dep-fake-{id(self):x}"
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        if port is None:
            port = self._control.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._control.bind(f"tcp://127.0.0.1:{port}")
        self.control_addr = f"tcp://127.0.0.1:{port}"
        self._pub = self._context.socket(zmq.PUB)
        self.pub_addr = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._outbox: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def topology(self) -> Topology:
        return topology(self.engines, epoch=self.epoch, model=self.model_info)

    def publish(self, message) -> None:
        with self._lock:
            self._outbox.append(message)

    def set_engines(self, engines) -> None:
        self.engines = list(engines)
        self.epoch += 1
        self.publish(self.topology())

    def _run(self):
        from dpserve_shared.schema import RegisterAck, RegisterFrontend

        while not self._stop.is_set():
            if self._control.poll(10):
                identity, *parts = self._control.recv_multipart()
                envelope = split(parts)
                assert envelope is not None, parts
                message = self._decoder.decode(envelope[1])
                self.received.append(message)
                if isinstance(message, RegisterFrontend):
                    ack = RegisterAck(self.accept, None if self.accept else "refused by test",
                                      pub_addr=self.pub_addr, topology=self.topology())
                    self._control.send_multipart([identity, *frames(self.deployment_id, ack)])
            with self._lock:
                outbox, self._outbox = self._outbox, []
            for message in outbox:
                self._pub.send_multipart(frames(self.deployment_id, message))

    def of_type(self, cls):
        return [m for m in self.received if isinstance(m, cls)]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self._control.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()
