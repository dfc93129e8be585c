"""The mixture-of-experts model (moe.py, model.py): routing, the grouped experts against a per-token reference,
expert sharding across simulated ranks against the unsharded model, and the upcycled model against its dense one.

Ranks are simulated in-process by the fakes of `moe.ExpertComm` in `_expert_comm.py`: one MoE layer per rank in
sequence (`RecordingComm`), or whole models on N threads meeting at a barrier in every collective (`ThreadComm`).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dpserve_engine.model import ModelArgs, Precision, build_model
from dpserve_engine.model_files import UpcycleSpec, parse_upcycled
from dpserve_engine.moe import ExpertComm, MoEFeedForward, expert_range, route
from dpserve_engine.moe_weights import random_mixtral_state, upcycle
from tests.unit._expert_comm import RecordingComm, ThreadComm, ThreadGroup, prefill, run_ranks

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")
ARGS = ModelArgs(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=256,
                 tie_embeddings=False, num_experts=4, num_experts_per_tok=2)  # fmt: skip


@pytest.fixture(scope="module")
def state():
    torch.set_num_threads(1)
    return random_mixtral_state(ARGS, seed=3)


@pytest.fixture(scope="module")
def model(state):
    return build_model(ARGS, state, Precision.fp32(), CPU)


# -- routing and the grouped experts ---------------------------------------------------------------------------


def test_route_keeps_the_top_k_and_renormalizes():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]])
    weights, ids = route(logits, 2)
    assert ids[0].tolist() == [1, 3] and sorted(ids[1].tolist()) == [0, 1]
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    p = logits[0].softmax(-1)
    assert torch.allclose(weights[0], torch.stack([p[1], p[3]]) / (p[1] + p[3]))
    assert torch.allclose(weights[1], torch.tensor([0.5, 0.5]))


def per_token_reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer's definition, token by token: sum of w_k * SwiGLU_k(x) over the top-k experts."""
    weights, ids = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            w13, w2 = moe.w13[e], moe.w2[e]
            gate, up = (w13 @ x[t]).split(moe.ffn_dim)
            out[t] += w * (w2 @ (torch.nn.functional.silu(gate) * up))
    return out


def test_grouped_experts_equal_the_per_token_definition(model):
    moe = model.layers[0].feed_forward
    x = torch.randn(37, ARGS.dim, generator=torch.Generator().manual_seed(0))
    _, ids = moe.route(x)
    assert len(set(ids.view(-1).tolist())) == ARGS.num_experts  # every expert gets tokens
    torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-5)
    assert moe(x[:0]).shape == (0, ARGS.dim)


def test_expert_range_is_a_contiguous_even_split():
    assert [list(expert_range(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(expert_range(4, 0, 1)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot be split evenly over 3"):
        expert_range(4, 0, 3)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        expert_range(4, 2, 2)


# -- sharding across simulated ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_layer_sums_to_the_unsharded_layer(state, world_size):
    """Each rank holds E/N experts and routes every rank's tokens; a rank with no tokens still takes part. The
    ranks' partial outputs sum to the unsharded layer's output, exactly (top-2: each token's two contributions
    are added in the same order either way)."""
    full = build_model(ARGS, state, Precision.fp32(), CPU).layers[1].feed_forward
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, ARGS.dim, generator=gen) for n in (9, 0, 5, 3)[:world_size]]
    partials = []
    for rank in range(world_size):
        shard = build_model(ARGS, state, Precision.fp32(), CPU, expert_ids=expert_range(4, rank, world_size))
        moe = shard.layers[1].feed_forward
        assert moe.w13.shape[0] == 4 // world_size
        moe.comm = comm = RecordingComm(rank, inputs)
        moe(inputs[rank])
        partials.append(comm.partial)
    assert torch.equal(functools.reduce(torch.add, partials), full(torch.cat(inputs)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_model_equals_the_unsharded_model(model, state, world_size):
    """Whole models on N simulated ranks, each with its own prompt (attention per rank) and E/N experts; the last
    rank has no work and runs dummy forwards. Every rank's hidden states equal the unsharded model's on its
    prompt alone, and every rank made the same number of collectives (2 per MoE layer per forward)."""
    group = ThreadGroup(world_size)
    prompts = [[(7 * r + 3 * j) % 280 + 10 for j in range(5 + 4 * r)] for r in range(world_size - 1)]
    shards = [build_model(ARGS, state, Precision.fp32(), CPU, expert_ids=expert_range(4, r, world_size))
              for r in range(world_size)]  # fmt: skip

    def work(rank):
        shards[rank].set_expert_comm(ThreadComm(group, rank))
        if rank == world_size - 1:
            shards[rank].dummy_forward()
            return None
        return prefill(shards[rank], prompts[rank])

    outputs = run_ranks(world_size, work)
    for rank, prompt in enumerate(prompts):
        torch.testing.assert_close(outputs[rank], prefill(model, prompt), rtol=1e-5, atol=1e-5)
    assert group.num_collectives == [2 * ARGS.n_layers] * world_size


def test_a_rank_must_hold_its_own_experts(state, model):
    with pytest.raises(ValueError, match=r"rank 1 of 2 must hold experts 2\.\.3"):
        model.set_expert_comm(ThreadComm(ThreadGroup(2), 1))
    shard = build_model(ARGS, state, Precision.fp32(), CPU, expert_ids=[2, 3])
    shard.set_expert_comm(ThreadComm(ThreadGroup(2), 1))
    assert isinstance(shard.moe_layers[0].comm, ExpertComm) and shard.expert_ids == [2, 3]
    shard.set_expert_comm(None)
    assert shard.moe_layers[0].comm is None
    with pytest.raises(ValueError, match="dense model"):
        build_model(dataclasses.replace(ARGS, num_experts=0), None, Precision.fp32(), CPU, expert_ids=[0])


# -- upcycling a dense model -----------------------------------------------------------------------------------


DENSE = dataclasses.replace(ARGS, num_experts=0, num_experts_per_tok=0)


@pytest.fixture(scope="module")
def dense():
    """A random dense model's HF-named state dict and the model."""
    model = build_model(DENSE, None, Precision.fp32(), CPU)
    state = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        kv_size = DENSE.n_kv_heads * DENSE.head_dim
        q, k, v = layer.attention.wqkv.weight.split([DENSE.n_heads * DENSE.head_dim, kv_size, kv_size])
        state.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attention.wo.weight})
        gate, up = layer.feed_forward.w13.weight.split(DENSE.ffn_dim)
        state.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.feed_forward.w2.weight})
        state[p + "input_layernorm.weight"] = layer.attention_norm.weight
        state[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
    state["model.embed_tokens.weight"] = model.tok_embeddings.weight
    state["lm_head.weight"] = model.output.weight
    state["model.norm.weight"] = model.norm.weight
    assert torch.equal(build_model(DENSE, state, Precision.fp32(), CPU).output.weight, model.output.weight)
    return state, model


PROMPT = [(13 * j) % 280 + 10 for j in range(11)]


def test_upcycled_model_computes_the_dense_model(dense):
    state, dense_model = dense
    expected = prefill(dense_model, PROMPT)
    args, moe_state = upcycle(DENSE, state, UpcycleSpec(num_experts=4, top_k=2))
    assert args.num_experts == 4 and not any(".mlp." in k for k in moe_state)
    upcycled = build_model(args, moe_state, Precision.fp32(), CPU)
    _, ids = upcycled.layers[0].feed_forward.route(torch.randn(50, DENSE.dim))
    assert len(set(ids.view(-1).tolist())) > 2  # the random router spreads tokens over the experts
    torch.testing.assert_close(prefill(upcycled, PROMPT), expected, rtol=1e-5, atol=1e-5)
    # a zero router sends every token to experts 0 and 1 with weights 1/2: the dense MLP's very bits
    args, zero_state = upcycle(DENSE, state, UpcycleSpec(router="zero"))
    assert torch.equal(prefill(build_model(args, zero_state, Precision.fp32(), CPU), PROMPT), expected)


def test_noise_makes_routing_matter_and_is_the_same_on_every_rank(dense):
    state, dense_model = dense
    spec = UpcycleSpec(num_experts=4, noise=0.05, seed=7)
    args, full = upcycle(DENSE, state, spec)
    assert not torch.allclose(prefill(build_model(args, full, Precision.fp32(), CPU), PROMPT),
                              prefill(dense_model, PROMPT), atol=1e-3)  # fmt: skip
    _, half = upcycle(DENSE, state, spec, expert_ids=[2, 3])
    experts = {k for k in half if ".experts." in k}
    assert experts == {k for k in full if ".experts.2." in k or ".experts.3." in k}
    assert all(torch.equal(half[k], full[k]) for k in experts)
    w1 = "model.layers.1.block_sparse_moe.experts.{}.w1.weight"
    assert not torch.equal(full[w1.format(0)], full[w1.format(1)])


def test_upcycled_model_spec_parses_and_names_itself():
    assert parse_upcycled("smollm2") is None and parse_upcycled("/models/mixtral") is None
    assert parse_upcycled("smollm2-moe") == UpcycleSpec(4, 2)
    spec = parse_upcycled("smollm2-moe:8:noise=0.02:seed=3:top_k=1")
    assert spec == UpcycleSpec(num_experts=8, top_k=1, noise=0.02, seed=3)
    assert spec.served_name == "SmolLM2-135M-Instruct-MoE-8x-top1-noise0.02-seed3"
    assert parse_upcycled("smollm2-moe:2:router=zero").served_name == "SmolLM2-135M-Instruct-MoE-2x-top2-zero-router"
    for bad in ("smollm2-moe:x", "smollm2-moe:4:noise=a", "smollm2-moe:4:colour=red", "smollm2-moe:1",
                "smollm2-moe:4:router=best"):  # fmt: skip
        with pytest.raises(ValueError, match="expected --model smollm2-moe"):
            parse_upcycled(bad)


def test_bf16_experts_stay_close_to_fp32(state, model):
    """--dtype bfloat16 on CPU: bf16 router and experts, fp32 activations (model.Precision's CPU mix)."""
    bf16 = build_model(ARGS, state, Precision(torch.bfloat16, torch.float32, torch.float32, torch.float32), CPU)
    assert bf16.layers[0].feed_forward.w13.dtype == torch.bfloat16
    x = torch.randn(16, ARGS.dim, generator=torch.Generator().manual_seed(2))
    expected = model.layers[0].feed_forward(x)
    got = bf16.layers[0].feed_forward(x)
    assert got.dtype == torch.float32
    assert (got - expected).norm() / expected.norm() < 0.05  # bf16 rounding, and near-tied routes may swap
