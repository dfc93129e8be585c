"""vLLM's elastic-EP admin endpoints, answered by asking the coordinator (the same ScaleRequest as `dpserve scale`).

- POST /scale_elastic_ep {"new_data_parallel_size": K, "drain_timeout": S (default 120)}: 200
  {"message": "Scaled to K data parallel engines"} once the step is done; 400 for a bad size, 503 when the
  coordinator refuses now (a step in progress, still starting, shutting down) or does not answer, 500 when the
  step fails (the error says which ranks). Served ranks keep serving throughout.
- POST /is_scaling_elastic_ep: {"is_scaling_elastic_ep": true} while the topology has ranks starting or draining,
  or fewer ready ranks than the target.
Both need the API key when one is set (they change or reveal the deployment).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from dpserve_shared.codec import from_coordinator_decoder
from dpserve_shared.envelope import frames, split
from dpserve_shared.schema import MAX_DATA_PARALLEL_SIZE, EngineState, ScaleAck, ScaleRequest
from dpserve_shared.zmq_security import ZmqSecurity

from dpserve_frontend.errors import APIError, BadRequest, ServiceUnavailable
from dpserve_frontend.parsing import read_request
from dpserve_frontend.responses import json_response
from dpserve_frontend.state import FrontendState

log = logging.getLogger(__name__)

ADMIN_PATHS = ("/scale_elastic_ep", "/is_scaling_elastic_ep")
_ACK_TIMEOUT_S = 10.0
_STEP_MARGIN_S = 600.0  # on top of the drain timeout: new ranks load their model (--engine-startup-timeout-s)


class ScaleElasticEpRequest(msgspec.Struct, forbid_unknown_fields=True):
    new_data_parallel_size: int
    drain_timeout: float = 120.0


class ScaleFailed(APIError):
    status = 500


async def scale_elastic_ep(request: web.Request, state: FrontendState) -> web.Response:
    req = await read_request(request, ScaleElasticEpRequest, state.settings.strict_request_fields)
    if not 1 <= req.new_data_parallel_size <= MAX_DATA_PARALLEL_SIZE:
        raise BadRequest(
            f"new_data_parallel_size must be between 1 and {MAX_DATA_PARALLEL_SIZE}, got {req.new_data_parallel_size}",
            param="new_data_parallel_size",
        )
    if req.drain_timeout < 0:
        raise BadRequest(f"drain_timeout must not be negative, got {req.drain_timeout:g}", param="drain_timeout")
    if not state.settings.coordinator_addr:
        raise ServiceUnavailable("this frontend has no coordinator to scale")
    log.info("scale_elastic_ep: asking the coordinator for %d ranks", req.new_data_parallel_size)
    ack = await _ask_coordinator(state.settings.coordinator_addr, state.settings.deployment_id, req,
                                 state.settings.zmq_security)
    return json_response({"message": f"Scaled to {ack.data_parallel_size} data parallel engines"})


async def _ask_coordinator(
    addr: str, deployment_id: str, req: ScaleElasticEpRequest, zmq_security: ZmqSecurity
) -> ScaleAck:
    """ScaleRequest on a DEALER of its own; the first ack (accepted or refused), then the completion."""
    decoder = from_coordinator_decoder()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    zmq_security.client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"scale-http-{uuid.uuid4().hex[:12]}".encode())
    sock.connect(addr)
    try:
        await sock.send_multipart(
            frames(deployment_id, ScaleRequest(req.new_data_parallel_size, drain_timeout_s=req.drain_timeout))
        )
        ack = await _next_ack(sock, decoder, _ACK_TIMEOUT_S)
        if not ack.accepted:
            raise ServiceUnavailable(f"the coordinator refused the scale: {ack.error}")
        if not ack.is_complete:
            ack = await _next_ack(sock, decoder, (req.drain_timeout or 120.0) + _STEP_MARGIN_S)
        if not ack.accepted:
            raise ScaleFailed(f"scaling to {req.new_data_parallel_size} failed: {ack.error}")
        return ack
    finally:
        sock.close(0)


async def _next_ack(sock, decoder, timeout_s: float) -> ScaleAck:
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                envelope = split(await sock.recv_multipart())
                if envelope is None:
                    continue
                message = decoder.decode(envelope[1])
                if isinstance(message, ScaleAck):
                    return message
    except TimeoutError:
        raise ServiceUnavailable(f"no answer from the coordinator within {timeout_s:.0f} s") from None


async def is_scaling_elastic_ep(request: web.Request, state: FrontendState) -> web.Response:
    topology = state.pool.topology
    scaling = False
    if topology is not None:
        states = [e.state for e in topology.engines]
        ready = states.count(EngineState.READY)
        in_motion = any(s in (EngineState.STARTING, EngineState.DRAINING) for s in states)
        scaling = in_motion or ready != (topology.data_parallel_size or len(states))
    return json_response({"is_scaling_elastic_ep": scaling})
