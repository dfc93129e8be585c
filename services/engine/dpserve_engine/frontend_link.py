"""The engine's link to the frontends (the twin of the frontend's engine_pool.py).

One ROUTER, bound on a random port (or --port) and advertised to the coordinator as `input_addr`; every frontend
connects a DEALER whose identity is its frontend id. This module receives their messages (`EngineRequest`,
`AbortRequests`; the first message from a new frontend is answered with `EngineHello`), remembers which frontend
each request came from, queues outputs per frontend, and sends them as one `EngineOutputs` per frontend per step.
It never touches the engine core: service.py decides what a message does.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import defaultdict
from collections.abc import Iterator

import msgspec
import zmq

from dpserve_shared.codec import encode, engine_decoder
from dpserve_shared.schema import (
    AbortRequests,
    CoreUse,
    EngineHello,
    EngineLoad,
    EngineOutputs,
    EngineRequest,
    FrontendCount,
    RequestOutput,
)

from dpserve_engine.settings import ServiceSettings

log = logging.getLogger("dpserve.engine")

CLOSE_LINGER_MS = 1000  # on close, the last outputs (finished requests) still reach their frontends


def advertised_host(host: str, coordinator_addr: str) -> str:
    """The address frontends can reach when binding a wildcard: the interface that routes to the coordinator."""
    if host not in ("0.0.0.0", "*", ""):
        return host
    coordinator_host = coordinator_addr.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((coordinator_host, 9))
        return s.getsockname()[0]


class FrontendLink:
    def __init__(self, ctx: zmq.Context, settings: ServiceSettings):
        self._settings = settings
        self.frontend_socket = ctx.socket(zmq.ROUTER)
        self.input_addr = ""  # tcp://HOST:PORT, once bound
        self._decoder = engine_decoder()
        self._request_frontend: dict[str, bytes] = {}  # request id -> identity of the frontend that sent it
        self._known_frontends: set[bytes] = set()  # those that got their EngineHello
        self._pending: dict[bytes, list[RequestOutput]] = defaultdict(list)  # outputs not yet sent, per frontend
        # requests and prompt tokens received per frontend, cumulative (the coordinator's reservations end here)
        self._received: dict[bytes, list[int]] = {}
        self.num_received = 0

    def bind(self) -> str:
        sock = self.frontend_socket
        self._settings.zmq_security.server(sock, "engine socket")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop outputs for a slow frontend
        sock.setsockopt(zmq.RCVHWM, 0)
        # An API server that reconnects under the same id (restarted with --frontend-id, or its old connection not
        # yet timed out) takes the id over; by default ZMQ would refuse the new connection and its requests would
        # never be answered.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        host = self._settings.host
        bind_host = "*" if host in ("0.0.0.0", "*") else host
        if self._settings.port:
            sock.bind(f"tcp://{bind_host}:{self._settings.port}")
            port = self._settings.port
        else:
            port = sock.bind_to_random_port(f"tcp://{bind_host}")
        self.input_addr = f"tcp://{advertised_host(host, self._settings.coordinator_addr)}:{port}"
        log.info("engine socket bound at %s", self.input_addr)
        return self.input_addr

    @property
    def node_ip(self) -> str:
        return self.input_addr.split("://", 1)[1].rsplit(":", 1)[0]

    # -- in -------------------------------------------------------------------------------------------------------

    def receive(self, rank: int) -> Iterator[tuple[bytes, EngineRequest | AbortRequests | CoreUse]]:
        """Every queued message, without blocking: (frontend identity, request or abort), or a neighbour rank's
        CoreUse. A new frontend gets `EngineHello(rank)` first; undecodable and unexpected messages are logged and
        skipped."""
        while True:
            try:
                identity, data = self.frontend_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as e:
                log.warning("undecodable message from frontend %r: %s", identity, e)
                continue
            if isinstance(msg, CoreUse):  # another rank on this node, not a frontend
                yield identity, msg
                continue
            if identity not in self._known_frontends:
                self._known_frontends.add(identity)
                self.frontend_socket.send_multipart([identity, encode(EngineHello(rank))])
            if isinstance(msg, EngineRequest):
                self._count(identity, msg)
                yield identity, msg
            elif isinstance(msg, AbortRequests):
                yield identity, msg
            else:
                log.warning("unexpected %s from frontend %r", type(msg).__name__, identity)

    def _count(self, identity: bytes, request: EngineRequest) -> None:
        counts = self._received.get(identity)
        if counts is None:
            counts = self._received[identity] = [0, 0]
        counts[0] += 1
        counts[1] += request.routed_tokens if request.routed_tokens >= 0 else len(request.prompt_token_ids)
        self.num_received += 1

    def received(self) -> list[FrontendCount]:
        """Per frontend: the requests and prompt tokens received from it so far (EngineStats.received)."""
        return [FrontendCount(identity.decode(errors="replace"), n, tokens)
                for identity, (n, tokens) in self._received.items()]  # fmt: skip

    def track(self, request_id: str, identity: bytes) -> None:
        """Outputs of `request_id` go to `identity` until it finishes."""
        self._request_frontend[request_id] = identity

    def request_ids(self) -> list[str]:
        """Every request this engine still answers."""
        return list(self._request_frontend)

    def forget_frontend(self, frontend_id: str) -> list[str]:
        """A frontend is gone: drop what is queued for it and return the ids of its requests (now untracked)."""
        identity = frontend_id.encode()
        mine = [r for r, f in self._request_frontend.items() if f == identity]
        for request_id in mine:
            del self._request_frontend[request_id]
        self._known_frontends.discard(identity)
        self._pending.pop(identity, None)
        self._received.pop(identity, None)
        return mine

    # -- out ------------------------------------------------------------------------------------------------------

    def answer(self, identity: bytes, output: RequestOutput) -> None:
        """Queue an output for a request that is not tracked (one refused on arrival)."""
        self._pending[identity].append(output)

    def collect(self, outputs: list[RequestOutput]) -> None:
        """Queue outputs for the frontends their requests came from; a finished request is no longer tracked."""
        for output in outputs:
            identity = self._request_frontend.get(output.request_id)
            if identity is None:
                continue
            if output.finish_reason is not None:
                del self._request_frontend[output.request_id]
            self._pending[identity].append(output)

    def flush(self, load: EngineLoad) -> None:
        """One EngineOutputs per frontend with queued outputs, each carrying the current load."""
        if not self._pending:
            return
        now = time.time()
        for identity, outputs in self._pending.items():
            if outputs:
                self.frontend_socket.send_multipart([identity, encode(EngineOutputs(load.rank, outputs, load, now))])
        self._pending.clear()

    def close(self) -> None:
        self.frontend_socket.close(linger=CLOSE_LINGER_MS)
