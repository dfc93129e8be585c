"""The frontend's connections to the engine ranks, its table of requests in flight, and routing.

The pool owns the `Router`: `submit` picks the rank for a request (or takes its pin) and sends it there, and a
re-send after a rank was dropped is picked by the same router; nothing else picks ranks.

One DEALER per READY engine (identity = this frontend's id) connected to the engine's ROUTER, and one receive
task per DEALER that decodes `EngineOutputs` and hands each `RequestOutput` to the queue of the HTTP request
that owns it. The pool follows the coordinator's `Topology`:

- a READY rank that is new (or moved to a new address) is connected and becomes routable;
- a DRAINING rank stays connected, so its requests finish, but gets no new ones;
- a rank that disappears or is DEAD is dropped: outputs already queued on its socket are handed out first (a
  rank removed by a scale-down finished its requests before it left), then its requests move to another serving
  rank (migration): one that has produced no token yet is re-sent as it was (an engine leaves requests that reach
  it while it shuts down unanswered); one whose stream has started is sent as its continuation (the prompt plus
  every token generated so far, the remaining max_tokens and min_tokens, seeded draws going on at the next output
  position: `continuation`), and its stream goes on where it stopped. A request moves at most `migration_limit`
  times (a request that has no token yet, at least once); after that, or with no rank serving, it ends with an
  ERROR output.

The router's loads follow the coordinator's `LoadSnapshot` (`apply_snapshot`), as does the pool's view of the
wave (stamped on every request; a request while the engines look paused asks the coordinator to start a wave).
New requests pass the router's admission control (`admission`: no rank with room -> `QueuesFull`, nothing sent);
re-sends never do. At the end of a drain `fail_all` ends what is still in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import msgspec
import zmq
import zmq.asyncio

from dpserve_shared.block_hash import block_hash, block_hashes
from dpserve_shared.codec import encode, frontend_decoder
from dpserve_shared.schema import (
    AbortRequests,
    EngineHello,
    EngineLoad,
    EngineOutputs,
    EngineRequest,
    EngineState,
    FinishReason,
    LoadSnapshot,
    RankCount,
    RequestOutput,
    StartWaveRequest,
    Topology,
)
from dpserve_shared.waves import FrontendWaves
from dpserve_shared.zmq_security import ZmqSecurity

from dpserve_frontend.engine_liveness import enable_heartbeats, stop_watching, watch_connection
from dpserve_frontend.prefix_index import PrefixIndex
from dpserve_frontend.router import AdmissionLimits, NoEngineAvailable, Router, RoutingPolicy
from dpserve_frontend.routing_cost import PromptMatch

log = logging.getLogger(__name__)

OutputQueue = asyncio.Queue  # items: (seq_index, RequestOutput)

_MAX_DRAIN = 512  # messages taken per wake-up of a receive task before it yields to the loop


@dataclasses.dataclass
class _InFlight:
    request: EngineRequest  # as first submitted (a continuation is built from it and `token_ids`)
    queue: OutputQueue
    seq_index: int
    rank: int
    token_ids: list[int] = dataclasses.field(default_factory=list)  # every output token so far, on any rank
    migrations: int = 0
    epoch: int = -1  # the router's snapshot epoch when it was (last) routed (Router.finished)


def continuation(request: EngineRequest, token_ids: list[int]) -> EngineRequest:
    """What a live rank is sent for `request` once it has produced `token_ids` on a rank that died: those tokens
    become prompt, the budgets shrink by their count, and the prompt's logprobs (already delivered) are not asked
    again; a seeded request's draws continue at output position len(token_ids) (EngineRequest.num_generated)."""
    sampling = request.sampling
    done = len(token_ids)
    sampling = msgspec.structs.replace(
        sampling, max_tokens=sampling.max_tokens - done, min_tokens=max(0, sampling.min_tokens - done),
        prompt_logprobs=None,
    )  # fmt: skip
    return msgspec.structs.replace(request, prompt_token_ids=request.prompt_token_ids + token_ids, sampling=sampling,
                                   num_generated=request.num_generated + done)  # fmt: skip


@dataclasses.dataclass
class _EngineConn:
    rank: int
    input_addr: str
    socket: zmq.asyncio.Socket
    state: EngineState
    recv_task: asyncio.Task | None = None
    watch_task: asyncio.Task | None = None  # engine_liveness.watch_connection: drops it while the coordinator is away
    sync: zmq.Socket | None = None  # a synchronous shadow of `socket`: non-blocking receives without futures


class EnginePool:
    def __init__(
        self,
        frontend_id: str,
        context: zmq.asyncio.Context | None = None,
        on_engine_load: Callable[[EngineLoad], None] | None = None,
        on_start_wave: Callable[[StartWaveRequest], None] | None = None,
        on_resend: Callable[[], None] | None = None,
        migration_limit: int = 3,
        admission: AdmissionLimits | None = None,
        zmq_security: ZmqSecurity | None = None,
        routing: RoutingPolicy = RoutingPolicy.LEAST_LOADED,
    ):
        self.frontend_id = frontend_id
        self._zmq_security = zmq_security or ZmqSecurity.from_environment()  # CURVE to the engines' sockets
        self._router = Router(routing)
        self.prefix_index = PrefixIndex()  # every rank's prefix cache, as the coordinator publishes it
        self.block_size = 0  # the engines' KV block size (from the topology; 0: unknown, no prefix routing)
        self._engine_ids: dict[int, str] = {}  # rank -> its engine's id (topology)
        self._routed: dict[int, list] = {}  # rank -> [engine id, requests, prompt tokens] routed to that engine
        self.routed_version = 0  # grows with every send (RoutedRequests goes to the coordinator when it moved)
        self.admission = admission or AdmissionLimits()
        self._context = context or zmq.asyncio.Context.instance()
        self._engines: dict[int, _EngineConn] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._topology_epoch = -1
        self.expected_size = 0  # the data-parallel size the topology asks for
        self.topology: Topology | None = None  # the newest applied
        self._on_engine_load = on_engine_load
        self.on_start_wave = on_start_wave
        self._on_resend = on_resend
        self.migration_limit = migration_limit
        # Called with every routing decision: why (Router.last_reason) and the load snapshot's age in s (None
        # before the first); the routing metrics
        self.on_routed: Callable[[str, float | None], None] | None = None
        self._snapshot_time_s = 0.0  # the newest snapshot's time.time() at the coordinator
        # Set by the coordinator link: whether the coordinator's broadcast has gone silent (engine_liveness.py)
        self.is_coordinator_away: Callable[[], bool] = lambda: False
        # The wave the coordinator last published, and whether the engines looked paused (dpserve_shared.waves).
        self.waves = FrontendWaves()

    @property
    def router(self) -> Router:
        """For inspection (serving ranks, costs): ranks are picked only by `submit` and re-sends."""
        return self._router

    # -- topology and load ---------------------------------------------------------------------------------------------

    def apply_topology(self, topology: Topology) -> None:
        if topology.epoch < self._topology_epoch:
            return  # an older broadcast overtaken by a newer ack (or the reverse)
        self._topology_epoch = topology.epoch
        self.topology = topology
        self.expected_size = topology.data_parallel_size or len(topology.engines)
        listed = {info.rank: info for info in topology.engines}
        self.block_size = next((info.block_size for info in topology.engines if info.block_size), self.block_size)
        self._engine_ids = {info.rank: info.engine_id for info in topology.engines}
        for rank in [r for r in self._routed if r not in listed]:
            del self._routed[rank]
        gone = []
        for rank, conn in self._engines.items():
            info = listed.get(rank)
            if info is None or info.state == EngineState.DEAD or info.input_addr != conn.input_addr:
                gone.append((rank, "gone" if info is None else info.state.value))
                conn.state = EngineState.DEAD
            else:
                conn.state = info.state
        # Connect newcomers before dropping the gone, so that orphaned requests can move to them.
        for rank, info in listed.items():
            if info.state == EngineState.READY and rank not in self._engines and info.input_addr:
                self._connect(rank, info.input_addr)
        self._router.set_serving(self._ready_ranks())
        for rank, reason in gone:
            self._drop(rank, reason)
        for rank, info in listed.items():  # a rank that moved to a new address
            if info.state == EngineState.READY and rank not in self._engines and info.input_addr:
                self._connect(rank, info.input_addr)
        self._router.set_serving(self._ready_ranks())

    def apply_snapshot(self, snapshot: LoadSnapshot) -> None:
        """A newer coordinator snapshot: the router's loads and the wave."""
        self._snapshot_time_s = snapshot.timestamp
        self._router.update_snapshot(snapshot.loads)
        self.waves.on_snapshot(snapshot.wave, snapshot.engines_running)

    @property
    def serving_ranks(self) -> list[int]:
        """The ranks new requests may go to: READY in the topology and connected."""
        return self._router.serving_ranks

    def _ready_ranks(self) -> list[int]:
        return sorted(r for r, c in self._engines.items() if c.state == EngineState.READY)

    @property
    def connected_ranks(self) -> list[int]:
        return sorted(self._engines)

    def _connect(self, rank: int, input_addr: str) -> None:
        socket = self._context.socket(zmq.DEALER)
        self._zmq_security.client(socket)
        socket.setsockopt(zmq.IDENTITY, self.frontend_id.encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        enable_heartbeats(socket)
        socket.connect(input_addr)
        conn = _EngineConn(rank, input_addr, socket, EngineState.READY, sync=zmq.Socket.shadow(socket.underlying))
        loop = asyncio.get_running_loop()
        conn.recv_task = loop.create_task(self._recv_loop(conn), name=f"engine-recv-{rank}")
        conn.watch_task = loop.create_task(
            watch_connection(socket, self.is_coordinator_away, lambda reason: self._drop_unreachable(conn, reason)),
            name=f"engine-watch-{rank}",
        )
        self._engines[rank] = conn
        log.info("connected to engine rank %d at %s", rank, input_addr)

    def _drop_unreachable(self, conn: _EngineConn, reason: str) -> None:
        if self._engines.get(conn.rank) is conn:
            conn.watch_task = None  # it is the caller, and returns
            self._drop(conn.rank, reason)

    def _drop(self, rank: int, reason: str) -> None:
        conn = self._engines.pop(rank)
        self._take_queued(conn, frontend_decoder().decode)  # a drained rank's last outputs still arrive
        _disconnect(conn, linger_ms=0)
        self._router.set_serving(self._ready_ranks())
        orphans = [(rid, entry) for rid, entry in self._in_flight.items() if entry.rank == rank]
        num_resent = 0
        for request_id, entry in orphans:
            if self._may_move(entry) and self._resend(entry):
                num_resent += 1
                continue
            del self._in_flight[request_id]
            entry.queue.put_nowait(
                (
                    entry.seq_index,
                    RequestOutput(
                        request_id,
                        finish_reason=FinishReason.ERROR,
                        error=f"engine rank {rank} went away ({reason}) while serving this request",
                    ),
                )
            )
        log.warning(
            "dropped engine rank %d (%s): %d requests in flight, %d moved to other ranks, %d failed",
            rank, reason, len(orphans), num_resent, len(orphans) - num_resent,
        )

    def _take_queued(self, conn: _EngineConn, decode, limit: int | None = None) -> bool:
        """Handle the messages queued on the rank's socket now, at most `limit`; True if more may be waiting."""
        recv_now, handle, again, noblock = conn.sync.recv, self._handle, zmq.Again, zmq.NOBLOCK
        taken = 0
        while limit is None or taken < limit:
            try:
                data = recv_now(noblock)
            except again:
                return False
            handle(conn, decode, data)
            taken += 1
        return True

    # -- requests ---------------------------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest], queue: OutputQueue, pinned_rank: int | None = None,
               session_id: str | None = None) -> int:  # fmt: skip
        """Route a request's sequences to one rank (the router's pick, or `pinned_rank`; `session_id`: the
        conversation's rank while it has room, router.py) and send them there;
        their outputs arrive on `queue` as (seq_index, output). Returns the rank. Raises `NoEngineAvailable` when
        no rank serves, `RankNotServing` for a pin that does not and `QueuesFull` when admission control refuses
        it (then nothing is sent)."""
        num_tokens = sum(len(request.prompt_token_ids) for request in requests)
        first = requests[0]
        prompt = self._match_prompt(first.prompt_token_ids, first.sampling.max_tokens) if pinned_rank is None else None
        rank = self._router.pick(pinned_rank, num_seqs=len(requests), num_tokens=num_tokens, limits=self.admission,
                                 prompt=prompt, session_id=session_id)  # fmt: skip
        if rank not in self._engines:
            raise NoEngineAvailable(f"engine rank {rank} is not connected")
        if self.on_routed is not None:
            age_s = time.time() - self._snapshot_time_s if self._snapshot_time_s else None
            self.on_routed(self._router.last_reason, age_s)
        # The work this adds to the rank's queue: what its prefix cache does not hold (the router counted the
        # same); the engine reports it back as received, which ends the coordinator's reservation of it.
        num_cached = prompt.num_cached_tokens(rank) if prompt is not None else 0
        self._count_routed(rank, len(requests), num_tokens - num_cached)
        wave, wake_up = self.waves.stamp(rank)
        for seq_index, request in enumerate(requests):
            request.frontend_id = self.frontend_id
            request.wave = wave
            request.routed_tokens = len(request.prompt_token_ids) - (num_cached if seq_index == 0 else 0)
            self._in_flight[request.request_id] = _InFlight(request, queue, seq_index, rank, epoch=self._router.epoch)
            self._send(rank, request)
        if wake_up is not None and self.on_start_wave is not None:
            # The engines looked paused between waves: the coordinator wakes the other ranks too.
            self.on_start_wave(wake_up)
        return rank

    def _match_prompt(self, token_ids: list[int], max_tokens: int = 0) -> PromptMatch | None:
        """Cache-aware routing: the prompt hashed once (its full blocks) and matched against every rank's prefix
        cache at once (a rank holding them all still computes the last token: `PromptMatch.num_cached_tokens`).
        None for the other policies."""
        if self._router.policy is not RoutingPolicy.CACHE_AWARE:
            return None
        block_size = self.block_size
        max_blocks = len(token_ids) // block_size if block_size > 0 else 0
        hashes = block_hashes(token_ids, block_size, max_blocks=max_blocks) if max_blocks > 0 else []
        if not hashes:
            # Ties start at the hash of its partial first block (the same in every API server): distinct prompts
            # start at different ranks, so with no load to tell the ranks apart they spread
            first_block = token_ids[:block_size] if block_size > 0 else token_ids
            return PromptMatch(len(token_ids), tie_key=block_hash(None, first_block), num_output_tokens=max_tokens)
        return PromptMatch(len(token_ids), self.prefix_index.match(hashes), block_size, tie_key=hashes[0],
                           num_output_tokens=max_tokens)  # fmt: skip

    def _count_routed(self, rank: int, num_requests: int, num_tokens: int) -> None:
        engine_id = self._engine_ids.get(rank, "")
        counts = self._routed.get(rank)
        if counts is None or counts[0] != engine_id:  # a new engine on the rank: counted from 0
            counts = self._routed[rank] = [engine_id, 0, 0]
        counts[1] += num_requests
        counts[2] += num_tokens
        self.routed_version += 1

    def routed_counts(self) -> list[RankCount]:
        """What this API server has routed to each rank's engine (RoutedRequests.sent; cumulative)."""
        return [RankCount(rank, engine_id, n, tokens) for rank, (engine_id, n, tokens) in self._routed.items()]

    def _may_move(self, entry: _InFlight) -> bool:
        return entry.migrations < (self.migration_limit if entry.token_ids else max(1, self.migration_limit))

    def _resend(self, entry: _InFlight, exclude: int | None = None) -> bool:
        """Move a sequence whose rank was dropped (or gave it back) to the router's pick (as it was stamped: same
        wave): itself if it has no token yet, else its continuation. False when no (other) rank serves."""
        try:
            num_tokens = len(entry.request.prompt_token_ids) + len(entry.token_ids)
            rank = self._router.pick(exclude=exclude, num_tokens=num_tokens)
        except NoEngineAvailable:
            return False
        self._count_routed(rank, 1, num_tokens)
        entry.rank = rank
        entry.epoch = -1  # the router counted its tokens whole; it is not taken back (Router.finished)
        entry.migrations += 1
        entry.request.routed_tokens = -1  # counted whole on the new rank
        self._send(rank, continuation(entry.request, entry.token_ids) if entry.token_ids else entry.request)
        if self._on_resend is not None:
            self._on_resend()
        return True

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort on the owning engines; further outputs for these ids are dropped."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            entry = self._in_flight.pop(request_id, None)
            if entry is not None:
                by_rank.setdefault(entry.rank, []).append(request_id)
                self._router.finished(entry.rank, entry.epoch, entry.request.routed_tokens)
        for rank, ids in by_rank.items():
            if rank in self._engines:
                self._engines[rank].socket.send(encode(AbortRequests(ids)))

    def fail_all(self, retry_reason: str, message: str) -> int:
        """End every sequence in flight now with an ERROR output carrying `retry_reason` (the end of a drain) and
        abort it on its engine; returns how many there were."""
        request_ids = list(self._in_flight)
        for request_id in request_ids:
            entry = self._in_flight[request_id]
            output = RequestOutput(request_id, finish_reason=FinishReason.ERROR, error=message,
                                   retry_reason=retry_reason)  # fmt: skip
            entry.queue.put_nowait((entry.seq_index, output))
        self.abort(request_ids)
        return len(request_ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def _send(self, rank: int, message) -> None:
        # DEALER with no HWM: send never blocks, so it is called without await (zmq.asyncio returns a done future).
        self._engines[rank].socket.send(encode(message))

    async def _recv_loop(self, conn: _EngineConn) -> None:
        # Await one message, then drain whatever else is queued with plain non-blocking receives on a
        # synchronous shadow of the same socket: one zmq.asyncio future per wake-up instead of one per message
        # (its per-receive bookkeeping costs more than decoding an EngineOutputs). Bounded so that a flood
        # cannot starve the HTTP handlers of the loop.
        decode = frontend_decoder().decode
        recv_async = conn.socket.recv
        while True:
            self._handle(conn, decode, await recv_async())
            if self._take_queued(conn, decode, _MAX_DRAIN):
                await asyncio.sleep(0)  # still more: let the handlers run first

    def _handle(self, conn: _EngineConn, decode, data: bytes) -> None:
        try:
            message = decode(data)
        except msgspec.DecodeError as e:
            log.error("undecodable message from engine rank %d: %s", conn.rank, e)
            return
        if type(message) is EngineOutputs:
            self._dispatch(message)
        elif isinstance(message, EngineHello):
            log.debug("engine rank %d said hello", message.engine_rank)

    def _dispatch(self, message: EngineOutputs) -> None:
        if message.load is not None and self._on_engine_load is not None:
            self._on_engine_load(message.load)
        in_flight = self._in_flight
        for output in message.outputs:
            entry = in_flight.get(output.request_id)
            if entry is None:
                continue  # aborted or finished here already
            if output.finish_reason == FinishReason.ABORT and not output.new_token_ids and self._may_move(entry):
                # not asked for by this frontend (its aborts leave the table first): the engine is stopping at
                # once and gives the request back; it moves as a dead rank's would, unless no other rank serves
                if self._resend(entry, exclude=message.engine_rank):
                    log.info("engine rank %d gave request %s back: moved to rank %d", message.engine_rank,
                             output.request_id, entry.rank)  # fmt: skip
                    continue
            entry.token_ids += output.new_token_ids
            if output.finish_reason is not None:
                del in_flight[output.request_id]
                self._router.finished(entry.rank, entry.epoch, entry.request.routed_tokens)
            entry.queue.put_nowait((entry.seq_index, output))

    async def close(self) -> None:
        """Abort what is still in flight and disconnect (lingering briefly so the aborts leave)."""
        self.abort(list(self._in_flight))
        for rank in list(self._engines):
            _disconnect(self._engines.pop(rank), linger_ms=500)
        self._router.set_serving([])


def _disconnect(conn: _EngineConn, linger_ms: int) -> None:
    """Stop the rank's tasks, its socket's monitor (before the socket closes: engine_liveness.stop_watching), and
    close the socket."""
    for task in (conn.recv_task, conn.watch_task):
        if task is not None:
            task.cancel()
    stop_watching(conn.socket)
    conn.socket.close(linger=linger_ms)
