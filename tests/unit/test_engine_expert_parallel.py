"""EngineCore in expert-parallel mode (core.py: set_expert_comm, dummy_step, re-sharding) on a tiny random Mixtral
checkpoint, its ranks simulated in-process: each rank a real EngineCore stepped by the service's real `Lockstep`
(lockstep.py) on a thread of its own, the ranks meeting at a barrier in every collective (`_expert_comm.ThreadComm`)
and in the all-reduce of "has unfinished". What must hold: the ranks' greedy tokens equal a single-process
EngineCore's on the same requests; every step makes the same collectives on every rank (a rank with nothing to
run steps dummy forwards); a rank loads no experts before it knows its place, and re-sharding to another
(rank, world size) keeps, loads and drops the right experts and still computes the same tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dpserve_shared.schema import EngineRequest, SamplingParams

from dpserve_engine.core import EngineCore
from dpserve_engine.lockstep import Lockstep
from dpserve_engine.model import ModelArgs, Precision, build_model
from dpserve_engine.moe_weights import write_random_mixtral
from dpserve_engine.settings import EngineConfig
from tests.unit._expert_comm import ThreadComm, ThreadGroup, run_ranks

pytestmark = pytest.mark.timeout(120)

NUM_EXPERTS = 4
# rid -> (prompt token ids, max_tokens); rank 0 gets the first three, rank 1 the last, shorter one (so it then
# steps dummy forwards while rank 0 still decodes)
REQUESTS = {
    "a": ([1, 17, 300, 4000, 22, 9], 9),
    "b": ([5, 6, 7], 7),
    "c": (list(range(100, 130)), 6),
    "d": ([42, 43, 44, 45, 46], 3),
}
RANK_REQUESTS = [["a", "b", "c"], ["d"]]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("mixtral-ep")
    write_random_mixtral(str(path), num_experts=NUM_EXPERTS, top_k=2, seed=11)
    return str(path)


def config(path: str, **overrides) -> EngineConfig:
    return dataclasses.replace(EngineConfig(model=path, device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=8,
                                            dtype="float32", enforce_eager=True), **overrides)  # fmt: skip


def add(core: EngineCore, rids: list[str]) -> None:
    for rid in rids:
        prompt, max_tokens = REQUESTS[rid]
        core.add_request(EngineRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True)))  # fmt: skip


@pytest.fixture(scope="module")
def reference(mixtral_dir) -> dict[str, list[int]]:
    """Every request's greedy tokens from one EngineCore holding all experts, no group."""
    core = EngineCore(config(mixtral_dir))
    add(core, list(REQUESTS))
    tokens: dict[str, list[int]] = {rid: [] for rid in REQUESTS}
    while core.has_unfinished():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    assert all(len(tokens[rid]) == REQUESTS[rid][1] for rid in REQUESTS)
    return tokens


class ThreadExpertGroup(ThreadComm):
    """A ThreadComm that is also the lock-step group: the all-reduce of "has unfinished" over the threads."""

    collective_time_s = 0.0

    def all_reduce_has_unfinished(self, has_unfinished: bool) -> bool:
        return self.all_reduce_sync(has_unfinished, 0)[0]

    def all_reduce_sync(self, has_unfinished: bool, generation: int) -> tuple[bool, int]:
        values = self.group.exchange(self.rank, torch.tensor([int(has_unfinished), generation]))
        return any(bool(v[0].item()) for v in values), max(int(v[1].item()) for v in values)

    def close(self) -> None:
        pass


def run_wave(cores: list[EngineCore], rank_requests: list[list[str]]) -> tuple[dict[str, list[int]], list[Lockstep]]:
    """One wave over len(cores) ranks on threads: each core joins a fresh group as its index's rank, takes its
    requests, and steps in lock-step until the ranks agree none has work. -> tokens per request, the Locksteps."""
    group = ThreadGroup(len(cores))
    comms = [ThreadExpertGroup(group, rank) for rank in range(len(cores))]
    locksteps = []
    for rank, core in enumerate(cores):
        core.set_expert_comm(comms[rank])
        add(core, rank_requests[rank])
        lockstep = Lockstep(rank, comms[rank], core, sync_interval_steps=2)
        lockstep.waves.on_snapshot(0, engines_running=True)  # the coordinator started wave 0
        locksteps.append(lockstep)

    def work(rank: int) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {rid: [] for rid in rank_requests[rank]}
        while True:
            outputs, completed = locksteps[rank].step()
            for o in outputs:
                tokens[o.request_id] += o.new_token_ids
            if completed is not None:
                return tokens

    per_rank = run_ranks(len(cores), work)
    assert len(set(group.num_collectives)) == 1, f"the ranks' collectives differ: {group.num_collectives}"
    return {rid: t for tokens in per_rank for rid, t in tokens.items()}, locksteps


@pytest.fixture(scope="module")
def ep_cores(mixtral_dir) -> list[EngineCore]:
    return [EngineCore(config(mixtral_dir, enable_expert_parallel=True)) for _ in range(2)]


def test_a_rank_loads_no_experts_before_it_knows_its_place(mixtral_dir, ep_cores):
    core = ep_cores[0]
    assert core.supports_expert_parallel
    assert core.runner.model.expert_ids == [] and core.runner.model.expert_weight_bytes == 0
    assert core.kv_blocks_total == EngineCore(config(mixtral_dir)).kv_blocks_total  # KV sized by the flags alone
    add(core, ["d"])
    with pytest.raises(RuntimeError, match="no expert-parallel group yet"):
        core.step()
    core.abort(["d"])


def test_two_ranks_in_lock_step_equal_the_single_process_engine(ep_cores, reference):
    tokens, locksteps = run_wave(ep_cores, RANK_REQUESTS)
    assert tokens == reference
    assert [core.runner.model.expert_ids for core in ep_cores] == [[0, 1], [2, 3]]
    # rank 1 finished first and stepped dummy forwards; rank 0 at most until the next all-reduce after its last
    assert locksteps[0].num_dummy_steps < 2 < locksteps[1].num_dummy_steps
    assert all(ls.num_waves_completed == 1 and not ls.waves.running for ls in locksteps)


def test_a_step_that_schedules_nothing_still_runs_the_collectives(ep_cores):
    """step() with nothing to schedule (e.g. every request waits for KV blocks) matches a dummy step's collectives."""
    group = ThreadGroup(2)
    for rank, core in enumerate(ep_cores):
        core.set_expert_comm(ThreadComm(group, rank))
    run_ranks(2, lambda rank: ep_cores[rank].step() if rank == 0 else ep_cores[rank].dummy_step())
    num_moe_layers = len(ep_cores[0].runner.model.moe_layers)
    assert group.num_collectives == [2 * num_moe_layers] * 2  # gather + scatter_sum per MoE layer, on each rank


def test_resharding_swaps_ranks_and_joins_a_smaller_group(ep_cores, reference):
    """The same cores in a group with their ranks swapped (each drops its experts and loads the other's), then
    core 0 alone (rank 0 of 1: it loads the experts it lacks and keeps its own): the tokens stay the reference's."""
    swapped = [ep_cores[1], ep_cores[0]]
    tokens, _ = run_wave(swapped, RANK_REQUESTS)
    assert tokens == reference
    assert ep_cores[0].runner.model.expert_ids == [2, 3] and ep_cores[1].runner.model.expert_ids == [0, 1]
    kept = ep_cores[0].runner.model.layers[0].feed_forward.w13[0].clone()  # expert 2
    tokens, _ = run_wave([ep_cores[0]], [list(REQUESTS)])
    assert tokens == reference
    moe = ep_cores[0].runner.model.layers[0].feed_forward
    assert moe.expert_ids == [0, 1, 2, 3] and torch.equal(moe.w13[2], kept)


def test_a_dense_engine_has_no_expert_parallel_mode(model_info):
    args = ModelArgs(vocab_size=model_info.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48)
    model = build_model(args, None, Precision.fp32(), torch.device("cpu"))
    core = EngineCore.from_model(EngineConfig(device="cpu", num_kv_blocks=8, enforce_eager=True), model, model_info)
    assert not core.supports_expert_parallel
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        core.set_expert_comm(ThreadComm(ThreadGroup(1), 0))
