"""How many CPU threads this rank's torch ops use: the node's cores, shared by the ranks on it that have work.

With --num-threads N the count is fixed. Otherwise (the default on CPU) it follows what the other ranks on this
node are doing: the Topology says which ranks share the node (same node address), and each rank tells the others
directly (`CoreUse` to their ROUTERs, `NodePeers`) when it gets work or runs out of it, before that step's outputs
go out; the coordinator's LoadSnapshots say the same later and correct a lost notice. A rank alone with work takes
every core (a single stream decodes ~25 % faster on 2 threads than on 1), and when its neighbours get work too the
cores are split again (two ranks with two threads each on two cores run slower than with one each). Without the
notices a rank learnt that its neighbour had gone idle only from the next snapshot, up to ~250 ms later: at c=1,
where the router alternates ranks, every prompt was prefilled on one thread. The launcher's OMP_NUM_THREADS
(cores / local ranks) holds until the first change.
"""

from __future__ import annotations

import logging
import os
import time

import zmq
from dpserve_shared.codec import encode
from dpserve_shared.schema import CoreUse, EngineLoad, EngineState, Topology
from dpserve_shared.zmq_security import ZmqSecurity

log = logging.getLogger(__name__)

# A neighbour's own notice outranks the coordinator's snapshots this long: a snapshot can be that much older than
# the change it reports (engine stats at most every 50 ms and an idle loop's 100 ms poll, then the coordinator's
# 100 ms publishing interval), so one published before the notice would otherwise undo it.
NOTICE_HOLD_S = 0.5


def node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ThreadBudget:
    def __init__(self, enabled: bool, node_ip: str = "", cores: int | None = None):
        self.enabled = enabled  # False: --num-threads fixed the count (or no CPU model): never change it
        self.node_ip = node_ip  # this rank's node address, as the topology lists it
        self.cores = cores or node_cores()
        self.rank = -1
        self.addresses: dict[int, str] = {}  # the other ranks serving on this node -> their engine sockets
        self.current = -1  # unknown until the first change (the launcher's OMP_NUM_THREADS holds until then)
        self._busy: dict[int, bool] = {}  # neighbour -> has work, by its notices and the snapshots
        self._noticed_at: dict[int, float] = {}  # neighbour -> when its last notice came (monotonic)

    def on_topology(self, topology: Topology, rank: int) -> None:
        self.rank = rank
        serving = [e for e in topology.engines
                   if e.node_ip == self.node_ip and e.rank != rank and e.state in (EngineState.READY, EngineState.DRAINING)]  # fmt: skip
        self.addresses = {e.rank: e.input_addr for e in serving}
        for gone in set(self._busy) - set(self.addresses):
            self._busy.pop(gone, None)
            self._noticed_at.pop(gone, None)

    @property
    def neighbours(self) -> frozenset[int]:
        return frozenset(self.addresses)

    def on_loads(self, loads: list[EngineLoad], now: float | None = None) -> None:
        """A LoadSnapshot: every neighbour's state, except where its own, newer notice holds."""
        now = time.monotonic() if now is None else now
        for load in loads:
            if load.rank in self.addresses and now - self._noticed_at.get(load.rank, -NOTICE_HOLD_S) >= NOTICE_HOLD_S:
                self._busy[load.rank] = bool(load.num_running or load.num_waiting)
        self._apply()

    def on_notice(self, notice: CoreUse, now: float | None = None) -> None:
        """A neighbour's CoreUse: it has work now, or none."""
        if notice.rank not in self.addresses:
            return
        self._busy[notice.rank] = notice.busy
        self._noticed_at[notice.rank] = time.monotonic() if now is None else now
        self._apply()

    def wanted(self) -> int:
        """The threads for this rank: the node's cores over itself and its neighbours with work."""
        busy = sum(1 for rank in self.addresses if self._busy.get(rank))
        return max(1, self.cores // (1 + busy))

    def _apply(self) -> None:
        if not self.enabled:
            return
        want = self.wanted()
        if want != self.current:
            import torch  # here, not at the top: the service module stays importable without torch (null engine)

            torch.set_num_threads(want)
            log.debug("rank %d: %d torch threads (%d cores, busy neighbours %s)", self.rank, want, self.cores,
                      sorted(r for r in self.addresses if self._busy.get(r)))  # fmt: skip
            self.current = want


class NodePeers:
    """This rank's notices to the other ranks on its node: a DEALER to each one's engine socket, `CoreUse` when
    this rank gets work or runs out of it. Only where the thread count adapts (`ThreadBudget.enabled`)."""

    def __init__(self, ctx: zmq.Context, security: ZmqSecurity):
        self._ctx = ctx
        self._security = security
        self._sockets: dict[int, tuple[str, zmq.Socket]] = {}  # rank -> (address, DEALER)
        self._told: bool | None = None  # the state last sent

    def follow(self, rank: int, addresses: dict[int, str]) -> None:
        """Connect to the neighbours in `addresses` (rank -> engine socket), drop the others. A new one is told
        this rank's state at once."""
        for other in list(self._sockets):
            if self._sockets[other][0] != addresses.get(other):
                self._sockets.pop(other)[1].close(0)
        for other, address in addresses.items():
            if other in self._sockets:
                continue
            sock = self._ctx.socket(zmq.DEALER)
            self._security.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)  # a neighbour that stopped reading: drop notices, never block
            sock.setsockopt(zmq.IDENTITY, f"rank-{rank}-notices".encode())
            sock.connect(address)
            self._sockets[other] = (address, sock)
            if self._told is not None:
                self._send(sock, CoreUse(rank, self._told))

    def tell(self, rank: int, busy: bool) -> None:
        """Send `busy` to every neighbour if it differs from what they were last told."""
        if busy == self._told:
            return
        self._told = busy
        notice = CoreUse(rank, busy)
        for _, sock in self._sockets.values():
            self._send(sock, notice)

    @staticmethod
    def _send(sock: zmq.Socket, notice: CoreUse) -> None:
        try:
            sock.send(encode(notice), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        for _, sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
