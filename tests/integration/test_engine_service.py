"""The engine service in-process, against a fake coordinator: registration, routing of outputs, errors, aborts."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import zmq

from dpserve_engine.null_core import NullEngineCore
from dpserve_engine.coordinator_link import RegistrationFailed
from dpserve_engine.service import EngineService
from dpserve_engine.settings import ServiceSettings
from dpserve_shared.codec import coordinator_decoder, encode, engine_decoder, frontend_decoder
from dpserve_shared.envelope import frames, split
from dpserve_shared.zmq_security import ZmqSecurity
from dpserve_shared.schema import (
    CoreUse,
    EngineHello,
    EngineInfo,
    EngineState,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
    FrontendGone,
    Heartbeat,
    ModelInfo,
    RegisterAck,
    RegisterEngine,
    SamplingParams,
    Shutdown,
    Topology,
)

pytestmark = pytest.mark.timeout(30)

MODEL = ModelInfo(name="null", root="-", max_model_len=256, vocab_size=2000, tokenizer_json="{}")
DEPLOYMENT = "dep-test"  # the fake coordinator's deployment id


class FakeCoordinator:
    def __init__(self):
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        ZmqSecurity.from_environment().server(self.control, "control socket")
        ZmqSecurity.from_environment().server(self.pub, "broadcast socket")
        self.control_addr = f"tcp://127.0.0.1:{self.control.bind_to_random_port('tcp://127.0.0.1')}"
        self.pub_addr = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.decoder = coordinator_decoder()

    def recv(self, kind, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.control.poll(100):
                identity, *parts = self.control.recv_multipart()
                envelope = split(parts)
                assert envelope is not None, parts
                msg = self.decoder.decode(envelope[1])
                if isinstance(msg, kind):
                    self.last_envelope_id = envelope[0]
                    return identity, msg
        raise AssertionError(f"no {kind.__name__} from the engine")

    def send(self, identity: bytes, msg, deployment_id: str = DEPLOYMENT) -> None:
        self.control.send_multipart([identity, *frames(deployment_id, msg)])

    def publish(self, msg, deployment_id: str = DEPLOYMENT, pub=None) -> None:
        (pub or self.pub).send_multipart(frames(deployment_id, msg))

    def close(self):
        self.control.close(0)
        self.pub.close(0)
        self.ctx.term()


@pytest.fixture
def coordinator():
    fake = FakeCoordinator()
    yield fake
    fake.close()


def start_engine(coordinator, step_time_s: float = 0.0, **settings):
    core = NullEngineCore(MODEL, step_time_s=step_time_s)
    service = EngineService(ServiceSettings(coordinator_addr=coordinator.control_addr, rank=-1, **settings), core)
    errors = []

    def run():
        try:
            service.bind()
            service.register()
            service.run()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            service.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return service, thread, errors


@contextlib.contextmanager
def serving_engine(coordinator, rank: int, **settings):
    """An engine registered as `rank` and a ZMQ context for the test's sockets; both stopped at the end (and this
    process's torch thread count, which an engine with adaptive threads changes, restored)."""
    import torch

    threads = torch.get_num_threads()
    service, thread, errors = start_engine(coordinator, **settings)
    register(coordinator, rank=rank)
    ctx = zmq.Context()
    try:
        yield service, ctx
    finally:
        service.stop(drain=False, reason="test over")
        thread.join(10)
        ctx.destroy(0)
        torch.set_num_threads(threads)
    assert not thread.is_alive() and not errors


def register(coordinator, rank: int = 3) -> RegisterEngine:
    identity, msg = coordinator.recv(RegisterEngine)
    coordinator.send(identity, RegisterAck(accepted=True, rank=rank, pub_addr=coordinator.pub_addr))
    return msg


def frontend(service, ctx, name: bytes):
    sock = ctx.socket(zmq.DEALER)
    ZmqSecurity.from_environment().client(sock)
    sock.setsockopt(zmq.IDENTITY, name)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.input_addr)
    return sock


def outputs_until_finished(sock, request_ids: set[str]) -> dict[str, list]:
    decoder = frontend_decoder()
    found: dict[str, list] = {}
    while not request_ids <= {r for r, outs in found.items() if outs[-1].finish_reason is not None}:
        assert sock.poll(5000), f"no outputs; so far {found}"
        msg = decoder.decode(sock.recv())
        if isinstance(msg, EngineHello):
            continue
        assert isinstance(msg, EngineOutputs)
        assert msg.load is not None and msg.load.rank == msg.engine_rank
        for output in msg.outputs:
            found.setdefault(output.request_id, []).append(output)
    return found


def test_registers_serves_routes_and_answers_errors(coordinator):
    service, thread, errors = start_engine(coordinator)
    msg = register(coordinator, rank=3)
    assert msg.rank == -1 and msg.model == MODEL and msg.input_addr == service.input_addr
    ctx = zmq.Context()
    fe1, fe2 = frontend(service, ctx, b"fe-1"), frontend(service, ctx, b"fe-2")
    fe1.send(encode(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=3))))
    fe1.send(encode(EngineRequest("too-long", [1] * 300, SamplingParams(max_tokens=3))))
    fe2.send(encode(EngineRequest("b", [4, 5], SamplingParams(max_tokens=2))))
    got1 = outputs_until_finished(fe1, {"a", "too-long"})
    got2 = outputs_until_finished(fe2, {"b"})
    assert set(got1) == {"a", "too-long"} and set(got2) == {"b"}  # each frontend gets only its requests
    assert sum(len(o.new_token_ids) for o in got1["a"]) == 3
    assert got1["a"][-1].finish_reason == FinishReason.LENGTH
    assert got1["too-long"][-1].finish_reason == FinishReason.ERROR
    assert "max_model_len" in got1["too-long"][-1].error
    coordinator.recv(Heartbeat)
    coordinator.publish(Shutdown(drain=False))
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        coordinator.publish(Shutdown(drain=False))  # SUB may join late
        thread.join(0.1)
    assert not thread.is_alive() and not errors
    assert service.rank == 3
    ctx.destroy(0)


def test_an_api_server_reconnecting_under_its_id_takes_it_over(coordinator):
    """A restarted API server (same --frontend-id) whose old connection is still open gets its answers: ZMQ's
    ROUTER would refuse the second connection under an id in use unless the engine sets ROUTER_HANDOVER."""
    with serving_engine(coordinator, rank=0) as (service, ctx):
        old = frontend(service, ctx, b"fe-same")
        old.send(encode(EngineRequest("before", [1, 2], SamplingParams(max_tokens=1))))
        assert set(outputs_until_finished(old, {"before"})) == {"before"}
        new = frontend(service, ctx, b"fe-same")  # the old socket stays connected
        new.send(encode(EngineRequest("after", [3, 4], SamplingParams(max_tokens=2))))
        got = outputs_until_finished(new, {"after"})
        assert sum(len(o.new_token_ids) for o in got["after"]) == 2


def test_ranks_on_one_node_tell_each_other_when_they_get_work_and_run_out_of_it(coordinator):
    """Adaptive threads: a rank sends CoreUse to the other ranks on its node (here a ROUTER standing in for rank 1)
    when it gets work and when it runs out, and takes a neighbour's CoreUse into its thread budget at once."""
    with serving_engine(coordinator, rank=0, step_time_s=0.01, adaptive_threads=True) as (service, ctx):
        neighbour = ctx.socket(zmq.ROUTER)
        ZmqSecurity.from_environment().server(neighbour, "test neighbour")
        neighbour_addr = f"tcp://127.0.0.1:{neighbour.bind_to_random_port('tcp://127.0.0.1')}"
        node = service.threads.node_ip
        deadline = time.monotonic() + 10
        while 1 not in service.threads.neighbours:  # the SUB joins late: publish until the topology lands
            assert time.monotonic() < deadline, "the topology never reached the engine"
            coordinator.publish(Topology(2, [EngineInfo(0, "e0", service.input_addr, EngineState.READY, node),
                                             EngineInfo(1, "e1", neighbour_addr, EngineState.READY, node)]))  # fmt: skip
            time.sleep(0.05)
        fe = frontend(service, ctx, b"fe-1")
        fe.send(encode(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=5))))
        assert outputs_until_finished(fe, {"a"})["a"][-1].finish_reason == FinishReason.LENGTH
        decoder = engine_decoder()
        notices = []
        while notices[-2:] != [CoreUse(0, busy=True), CoreUse(0, busy=False)]:
            assert neighbour.poll(5000), f"notices so far: {notices}"
            identity, data = neighbour.recv_multipart()
            notices.append(decoder.decode(data))
        # its state when it first saw the neighbour (idle), then one notice per change, none repeated
        assert notices in ([CoreUse(0, busy=False), CoreUse(0, busy=True), CoreUse(0, busy=False)],
                           [CoreUse(0, busy=True), CoreUse(0, busy=False)]), notices  # fmt: skip
        assert identity == b"rank-0-notices"
        # the other way: rank 1 says it has work (on a DEALER, as ranks connect); rank 0 halves its share
        peer = frontend(service, ctx, b"rank-1-notices")
        peer.send(encode(CoreUse(1, busy=True)))
        deadline = time.monotonic() + 5
        while not service.threads._busy.get(1):
            assert time.monotonic() < deadline, "rank 0 did not take the notice"
            time.sleep(0.01)
        assert service.threads.wanted() == max(1, service.threads.cores // 2)
        assert not peer.poll(200), "a neighbour is not a frontend: no EngineHello"


def test_frontend_gone_aborts_its_requests(coordinator):
    service, thread, errors = start_engine(coordinator, step_time_s=0.01)
    register(coordinator)
    ctx = zmq.Context()
    fe = frontend(service, ctx, b"fe-gone")
    fe.send(encode(EngineRequest("long", [1, 2], SamplingParams(max_tokens=200))))
    deadline = time.monotonic() + 10
    running = None
    while running != 1:  # the engine reports the request running...
        _, stats = coordinator.recv(EngineStats)
        running = stats.load.num_running
    while running != 0:  # ...and idle once the coordinator says its frontend is gone
        assert time.monotonic() < deadline, "request still running after FrontendGone"
        coordinator.publish(FrontendGone("fe-gone"))
        _, stats = coordinator.recv(EngineStats)
        running = stats.load.num_running + stats.load.num_waiting
    service.stop(drain=True, reason="test")
    thread.join(5)
    assert not thread.is_alive() and not errors
    ctx.destroy(0)


def test_refused_registration_fails_with_the_coordinators_reason(coordinator):
    service, thread, errors = start_engine(coordinator)
    identity, _ = coordinator.recv(RegisterEngine)
    coordinator.send(identity, RegisterAck(accepted=False, error="protocol mismatch"))
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], RegistrationFailed)
    assert "protocol mismatch" in str(errors[0])


def test_registers_again_when_the_coordinator_goes_silent(coordinator, monkeypatch):
    from dpserve_engine import coordinator_link

    monkeypatch.setattr(coordinator_link, "COORDINATOR_SILENCE_S", 0.5)
    service, thread, errors = start_engine(coordinator)
    first = register(coordinator, rank=1)
    # Nothing on the broadcast: the engine registers again, same id and rank; a "restarted" coordinator
    # answers with a new broadcast address, where the engine is then listening.
    identity, again = coordinator.recv(RegisterEngine)
    assert (again.engine_id, again.rank) == (first.engine_id, 1)
    new_pub = coordinator.ctx.socket(zmq.PUB)
    ZmqSecurity.from_environment().server(new_pub, "broadcast socket")
    new_pub_addr = f"tcp://127.0.0.1:{new_pub.bind_to_random_port('tcp://127.0.0.1')}"
    coordinator.send(identity, RegisterAck(accepted=True, rank=1, pub_addr=new_pub_addr))
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        coordinator.publish(Shutdown(drain=False), pub=new_pub)
        thread.join(0.1)
    new_pub.close(0)
    assert not thread.is_alive() and not errors


def test_failing_steps_fail_their_requests_then_end_the_engine(coordinator, monkeypatch):
    service, thread, errors = start_engine(coordinator)
    register(coordinator)

    def broken_step():
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(service.core, "step", broken_step)
    ctx = zmq.Context()
    fe = frontend(service, ctx, b"fe-1")
    fe.send(encode(EngineRequest("a", [1, 2], SamplingParams(max_tokens=3))))
    got = outputs_until_finished(fe, {"a"})
    assert got["a"][-1].finish_reason == FinishReason.ERROR
    assert "out of memory" in got["a"][-1].error
    for i in range(2):  # two more failures in a row end the loop
        fe.send(encode(EngineRequest(f"b{i}", [1, 2], SamplingParams(max_tokens=3))))
        outputs_until_finished(fe, {f"b{i}"})
    thread.join(5)
    assert not thread.is_alive() and not errors and service.exit_code == 1
    ctx.destroy(0)


def test_a_stray_shutdown_from_another_deployment_is_ignored(coordinator, caplog):
    """An engine started for deployment dep-test gets Shutdown on both of its coordinator links from a peer of
    another deployment (a stopping coordinator whose port it reached): it keeps serving, and says so once. Its own
    deployment's Shutdown stops it."""
    service, thread, errors = start_engine(coordinator, deployment_id=DEPLOYMENT)
    identity, _ = coordinator.recv(RegisterEngine)
    assert coordinator.last_envelope_id == DEPLOYMENT  # a pinned engine registers in its deployment's envelope
    coordinator.send(identity, RegisterAck(accepted=True, rank=0, pub_addr=coordinator.pub_addr))
    ctx = zmq.Context()
    fe = frontend(service, ctx, b"fe-1")
    for i in range(10):  # the SUB may join late: send the stray broadcast until it has surely arrived
        coordinator.publish(Shutdown(drain=False, reason="coordinator shutting down"), deployment_id="dep-other")
        coordinator.send(identity, Shutdown(drain=False, reason="scale-down"), deployment_id="dep-other")
        time.sleep(0.05)
    while service.coordinator.guard.num_dropped < 4:  # broadcasts and control messages both arrived and were dropped
        assert thread.is_alive(), errors
        time.sleep(0.05)
    fe.send(encode(EngineRequest("after", [1, 2], SamplingParams(max_tokens=3))))
    got = outputs_until_finished(fe, {"after"})
    assert got["after"][-1].finish_reason == FinishReason.LENGTH and thread.is_alive()
    assert caplog.text.count("from deployment 'dep-other'") == 1
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        coordinator.publish(Shutdown(drain=False))
        thread.join(0.1)
    assert not thread.is_alive() and not errors
    ctx.destroy(0)


def test_an_engine_whose_deployment_is_gone_exits(coordinator):
    """No broadcast from its own deployment for --register-timeout-s (its coordinator died without a teardown):
    an engine started for that deployment exits rather than linger for whoever takes the port next."""
    service, thread, errors = start_engine(coordinator, deployment_id=DEPLOYMENT, register_timeout_s=1.0)
    register(coordinator)
    for _ in range(30):  # another deployment's broadcasts are no sign of life of its own
        coordinator.publish(Heartbeat("x", 0.0), deployment_id="dep-other")
        thread.join(0.1)
        if not thread.is_alive():
            break
    assert not thread.is_alive() and not errors and service.exit_code == 1
