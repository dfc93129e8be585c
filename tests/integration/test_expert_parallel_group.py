"""The expert-parallel process group with 2 real processes on gloo (services/engine/dpserve_engine/expert_parallel.py).

Each process joins the group, runs ExpertParallelComm's gather / scatter_sum on plain tensors (uneven row counts,
a rank with 0 rows, every rank with 0 rows; a forward whose layers share one exchange of the row counts) and the
has-unfinished all-reduce, and checks the results itself;
the test checks both exit 0. A rank whose peer never comes fails with the address, the port and the timeout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = r"""
import sys
import torch
from dpserve_engine.expert_parallel import ExpertGroup, ExpertParallelComm, GroupAddress

port, rank = int(sys.argv[1]), int(sys.argv[2])
group = ExpertGroup.join(GroupAddress("127.0.0.1", port, world_size=2, rank=rank, timeout_s=60))
comm = ExpertParallelComm(group)
dim = 4

def rows(r, n):  # rank r's rows: distinct values, so a misplaced row shows
    return torch.arange(n * dim, dtype=torch.float32).view(n, dim) + 100 * (r + 1)

for num_rows in ([3, 1], [0, 2], [2, 0], [0, 0], [5, 5]):
    x = rows(rank, num_rows[rank])
    gathered, counts = comm.gather(x)
    assert counts == num_rows, (counts, num_rows)
    expected = torch.cat([rows(r, n) for r, n in enumerate(num_rows)])
    assert torch.equal(gathered, expected), (gathered, expected)
    # each rank's "experts" contribute (rank + 1) * row: the sum over ranks is 3 * row
    y = gathered * (rank + 1)
    mine = comm.scatter_sum(y, counts)
    assert torch.equal(mine, 3 * x), (mine, x)

# a forward of 3 MoE layers (begin_forward): the row counts travel once, in the first layer's gather
comm.begin_forward(3)
before = group.num_collectives
x = rows(rank, [2, 1][rank])
for _ in range(3):
    gathered, counts = comm.gather(x)
    assert counts == [2, 1] and torch.equal(gathered, torch.cat([rows(0, 2), rows(1, 1)]))
assert group.num_collectives - before == 1 + 3, group.num_collectives - before  # the counts once, the rows thrice

assert comm.all_reduce_has_unfinished(rank == 1) is True
assert comm.all_reduce_has_unfinished(rank == 0) is True
assert comm.all_reduce_has_unfinished(False) is False
assert group.num_collectives > 0 and group.collective_time_s > 0
group.close()
print("ok", rank)
"""


def _env() -> dict[str, str]:
    paths = [os.path.join(ROOT, p) for p in ("shared", "services/engine", "services/coordinator",
                                              "services/frontend", "")]  # fmt: skip
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _start(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout_s)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_two_ranks_gather_and_scatter_sum_over_gloo():
    port = free_port()
    results = _finish([_start(_WORKER, port, rank) for rank in (0, 1)], timeout_s=90)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{out}"
        assert f"ok {rank}" in out


_LONELY = r"""
import sys
from dpserve_engine.expert_parallel import ExpertGroup, ExpertGroupJoinFailed, GroupAddress

try:
    ExpertGroup.join(GroupAddress("127.0.0.1", int(sys.argv[1]), world_size=2, rank=1, timeout_s=2))
except ExpertGroupJoinFailed as e:
    print("FAILED:", e)
    sys.exit(3)
"""


def test_a_rank_whose_peer_never_comes_fails_naming_the_address_port_and_timeout():
    port = free_port()
    [(code, out)] = _finish([_start(_LONELY, port)], timeout_s=60)
    assert code == 3, out
    assert f"tcp://127.0.0.1:{port}" in out and "within 2 s" in out and "rank 1" in out
