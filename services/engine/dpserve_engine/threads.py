"""How many CPU threads this rank's torch ops use: the node's cores, shared by the ranks on it that have work.

With --num-threads N the count is fixed. Otherwise (the default on CPU) it follows the coordinator's broadcasts:
the Topology says which ranks share this node (same node address), each LoadSnapshot which of them have
requests. A rank alone with work takes every core (a single stream decodes ~25 % faster on 2 threads than on
1), and when its neighbours get work too the cores are split again (two ranks with two threads each on two
cores run slower than with one each). The snapshot comes at most every 100 ms after a change, so a split can be
late by that much; the launcher's OMP_NUM_THREADS (cores / local ranks) holds until the first snapshot.
"""

from __future__ import annotations

import logging
import os

from dpserve_shared.schema import EngineLoad, EngineState, Topology

log = logging.getLogger(__name__)


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
        self.neighbours: frozenset[int] = frozenset()  # other ranks serving on this node
        self.current = -1  # unknown until the first change (the launcher's OMP_NUM_THREADS holds until then)

    def on_topology(self, topology: Topology, rank: int) -> None:
        self.rank = rank
        self.neighbours = frozenset(
            e.rank
            for e in topology.engines
            if e.node_ip == self.node_ip and e.rank != rank and e.state in (EngineState.READY, EngineState.DRAINING)
        )

    def target(self, loads: list[EngineLoad]) -> int:
        busy = sum(1 for load in loads if load.rank in self.neighbours and (load.num_running or load.num_waiting))
        return max(1, self.cores // (1 + busy))

    def on_loads(self, loads: list[EngineLoad]) -> None:
        if not self.enabled:
            return
        want = self.target(loads)
        if want != self.current:
            import torch  # here, not at the top: the service module stays importable without torch (null engine)

            torch.set_num_threads(want)
            log.debug("rank %d: %d torch threads (%d cores, neighbours %s)", self.rank, want, self.cores,
                      sorted(self.neighbours))
            self.current = want
