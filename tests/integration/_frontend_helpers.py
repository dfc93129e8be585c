"""Shared by the frontend's integration tests: engines (the real EngineService over NullEngineCore, in a thread), a
fake coordinator for frontends, and an aiohttp test client of the frontend app. The `model_info` fixture is in
tests/conftest.py."""

import asyncio
import contextlib
import threading
import time
import uuid

import zmq

from dpserve_engine.null_core import NullEngineCore
from dpserve_engine.service import EngineService
from dpserve_engine.settings import ServiceSettings
from dpserve_shared.codec import coordinator_decoder
from dpserve_shared.envelope import frames, split
from dpserve_shared.zmq_security import ZmqSecurity
from dpserve_shared.schema import (
    EngineInfo,
    EngineRequest,
    EngineState,
    LoadSnapshot,
    RegisterAck,
    RegisterEngine,
    RegisterFrontend,
    Topology,
)

REGISTRAR_BROADCAST_S = 1.0  # a sign of life to the engine, as the coordinator's LoadSnapshot heartbeat is


class RecordingNullCore(NullEngineCore):
    """NullEngineCore that also records what the engine loop handed it: every request it was asked to queue (valid
    or not) and every id it was asked to abort."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.added: list[EngineRequest] = []
        self.aborted: list[str] = []

    def add_request(self, request: EngineRequest) -> None:
        self.added.append(request)
        super().add_request(request)

    def abort(self, request_ids):
        request_ids = list(request_ids)
        self.aborted.extend(request_ids)
        return super().abort(request_ids)


class _Registrar:
    """The coordinator's side of one engine's registration, no more: a control ROUTER that accepts RegisterEngine
    with the engine's rank and reads (and drops) what the engine sends after it, and a PUB whose periodic empty
    LoadSnapshot keeps the engine from registering again. Frontends in these tests get their topology from the
    test (or from FakeCoordinator below), not from here."""

    def __init__(self, rank: int):
        self.rank = rank
        self.deployment_id = f"dep-null-engine-{rank}-{id(self):x}"  # the engine adopts it from the ack
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        ZmqSecurity.from_environment().server(self._control, "control socket")
        self.control_addr = f"tcp://127.0.0.1:{self._control.bind_to_random_port('tcp://127.0.0.1')}"
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        ZmqSecurity.from_environment().server(self._pub, "broadcast socket")
        self.pub_addr = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._decoder = coordinator_decoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"registrar-{rank}", daemon=True)
        self._thread.start()

    def _run(self):
        next_broadcast = 0.0
        while not self._stop.is_set():
            if self._control.poll(20):
                identity, *parts = self._control.recv_multipart()
                envelope = split(parts)
                if envelope is not None and isinstance(self._decoder.decode(envelope[1]), RegisterEngine):
                    ack = RegisterAck(True, rank=self.rank, pub_addr=self.pub_addr)
                    self._control.send_multipart([identity, *frames(self.deployment_id, ack)])
            now = time.monotonic()
            if now >= next_broadcast:
                next_broadcast = now + REGISTRAR_BROADCAST_S
                self._pub.send_multipart(frames(self.deployment_id, LoadSnapshot()))

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self._control.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()


class NullEngine:
    """One engine rank in a thread: the real EngineService loop (EngineHello, per-frontend outputs, waves, drain,
    aborts) over a RecordingNullCore, bound on 127.0.0.1 and registered as `rank` with a _Registrar of its own.
    `requests()` and `aborted_ids()` say what reached its core."""

    def __init__(self, rank: int, model_info, step_time_s: float = 0.002, token_ids=None, **core_kwargs):
        self.rank = rank
        self.core = RecordingNullCore(model_info, step_time_s=step_time_s, token_ids=token_ids, **core_kwargs)
        self._registrar = _Registrar(rank)
        self.service = EngineService(ServiceSettings(coordinator_addr=self._registrar.control_addr, rank=rank),
                                     self.core)
        self._serving = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"engine-{rank}", daemon=True)
        self._thread.start()
        if not self._serving.wait(10):
            self.close()
            raise AssertionError(f"engine rank {rank} did not register: {self._errors}")
        self.input_addr = self.service.input_addr

    def _run(self):
        try:
            self.service.bind()
            self.service.register()
            self._serving.set()
            self.service.run()
        except BaseException as e:  # noqa: BLE001 - reported by close()
            self._errors.append(e)
        finally:
            self.service.close()

    def info(self, state=EngineState.READY) -> EngineInfo:
        return EngineInfo(self.rank, self.service.coordinator.engine_id, self.input_addr, state)

    def requests(self) -> list[EngineRequest]:
        return list(self.core.added)

    def aborted_ids(self) -> list[str]:
        return list(self.core.aborted)

    def stop(self) -> None:
        """The rank stops at once (its loop ends and its sockets close): what it was sent gets no answer."""
        self.service.stop(drain=False, reason="stopped by the test")
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), f"engine rank {self.rank} did not stop"

    def close(self):
        if self._thread.is_alive():
            self.stop()
        self._registrar.close()
        assert not self._errors, self._errors


def topology(engines, epoch=1, model=None, size=None) -> Topology:
    return Topology(epoch, [e.info() if isinstance(e, NullEngine) else e for e in engines], model,
                    size if size is not None else len(engines))


@contextlib.asynccontextmanager
async def frontend_client(model_info, engines=(), **settings_kwargs):
    """An aiohttp test client for a frontend app with no coordinator, connected to `engines`."""
    from aiohttp.test_utils import TestClient, TestServer

    from dpserve_frontend.app import STATE_KEY, init_app, server_options
    from dpserve_frontend.settings import FrontendSettings

    settings = FrontendSettings(frontend_id=f"fe-test-{uuid.uuid4().hex[:8]}", stats_interval_s=0, **settings_kwargs)
    app = init_app(settings, model_info=model_info)
    server = TestServer(app)
    await server.start_server(**server_options(settings))  # (TestServer() drops its own keyword arguments)
    client = TestClient(server)
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
        ZmqSecurity.from_environment().server(self._control, "control socket")
        if port is None:
            port = self._control.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._control.bind(f"tcp://127.0.0.1:{port}")
        self.control_addr = f"tcp://127.0.0.1:{port}"
        self._pub = self._context.socket(zmq.PUB)
        ZmqSecurity.from_environment().server(self._pub, "broadcast socket")
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
