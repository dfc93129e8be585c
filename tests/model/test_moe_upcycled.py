"""The upcycled SmolLM2 (`--model smollm2-moe[:E]`, moe_weights.upcycle) through EngineCore against the dense model,
all in fp32: with unperturbed experts it computes the dense model (the oracle for expert parallelism); with noise
routing matters; a rank's subset of the experts is the full model's, and two ranks sharing the experts compute
the single-process model."""

import pytest
import torch
from dpserve_shared.schema import EngineRequest, SamplingParams
from tokenizers import Tokenizer

from dpserve_engine.core import EngineCore
from dpserve_engine.model import Precision, build_model
from dpserve_engine.loader import load_weights
from dpserve_engine.model_info import load_model_info
from dpserve_engine.moe import expert_range
from dpserve_engine.settings import EngineConfig
from tests.conftest import TORCH_THREADS
from tests.unit._expert_comm import ThreadComm, ThreadGroup, prefill, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean.", "Name three primary colors."]


def fp32(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", quantization="none", dtype="float32", num_kv_blocks=128,
                        enforce_eager=True)  # fmt: skip


@pytest.fixture(scope="module")
def prompts():
    import jinja2.sandbox

    info = load_model_info(EngineConfig())
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        info.chat_template
    )
    render = lambda text: template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)  # noqa: E731
    return {f"p{i}": tokenizer.encode(render(p), add_special_tokens=False).ids for i, p in enumerate(PROMPTS)}


def generate(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 24):
    """Greedy tokens and each token's logprob, per request."""
    for rid, ids in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        core.add_request(EngineRequest(rid, ids, params))
    tokens, logprobs = {rid: [] for rid in prompts}, {rid: [] for rid in prompts}
    while core.has_unfinished():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [lp.logprob for lp in o.new_logprobs]
    return tokens, logprobs


@pytest.fixture(scope="module")
def dense(prompts):
    torch.set_num_threads(TORCH_THREADS)
    return generate(EngineCore(fp32("smollm2")), prompts)


def test_upcycled_model_equals_dense_smollm2(dense, prompts):
    """4 experts, top-2, random router: the tokens go to different experts, all copies of the dense MLP, whose
    renormalized weights sum to 1: the dense model's greedy tokens and (up to fp32 rounding) its logprobs."""
    core = EngineCore(fp32("smollm2-moe:4"))
    assert core.model_info.name == "SmolLM2-135M-Instruct-MoE-4x-top2"
    model = core.runner.model
    assert model.args.num_experts == 4 and model.expert_ids == [0, 1, 2, 3] and core.runner.compiled is None
    tokens, logprobs = generate(core, prompts)
    assert tokens == dense[0]
    for rid in prompts:
        torch.testing.assert_close(torch.tensor(logprobs[rid]), torch.tensor(dense[1][rid]), rtol=0, atol=1e-4)


def test_zero_router_upcycled_model_is_bit_identical(dense, prompts):
    """A zero router sends every token to experts 0 and 1 at 1/2 each: the dense MLP's very bits."""
    tokens, logprobs = generate(EngineCore(fp32("smollm2-moe:4:router=zero")), prompts)
    assert tokens == dense[0] and logprobs == dense[1]


def test_perturbed_experts_change_the_output(dense, prompts):
    """noise: each expert its own perturbed copy, so which experts a token goes to changes its logprobs (the noise
    is seeded per layer, expert and matrix: tests/unit/test_moe.py and the subset test below)."""
    core = EngineCore(fp32("smollm2-moe:4:noise=0.05:seed=1"))
    assert core.model_info.name == "SmolLM2-135M-Instruct-MoE-4x-top2-noise0.05-seed1"
    first = {"p0": prompts["p0"]}
    tokens, logprobs = generate(core, first, 8)
    assert len(tokens["p0"]) == 8 and logprobs["p0"] != dense[1]["p0"][:8]


def test_ranks_expert_subsets_equal_the_full_models_experts():
    """Each of 2 ranks loads only its 2 experts (per layer: the router, and experts 2r and 2r+1, perturbed exactly
    as the full model's), and builds a model holding just those."""
    config = fp32("smollm2-moe:4:noise=0.02")
    args, full = load_weights(config.model, config.cache_dir)
    for rank in range(2):
        ids = expert_range(4, rank, 2)
        _, state = load_weights(config.model, config.cache_dir, None, expert_ids=ids)
        experts = [k for k in state if ".experts." in k]
        assert {int(k.split(".experts.")[1].split(".")[0]) for k in experts} == set(ids)
        assert len(experts) == 30 * 2 * 3 and all(torch.equal(state[k], full[k]) for k in state)
        shard = build_model(args, state, Precision.fp32(), torch.device("cpu"), expert_ids=ids)
        assert shard.expert_ids == list(ids) and shard.layers[0].feed_forward.w13.shape[0] == 2


def test_expert_parallel_real_model_equals_the_single_process_model(prompts):
    """The perturbed model sharded over 2 simulated ranks (threads, tests/unit/_expert_comm.py), each prefilling
    its own prompt: each rank's next-token logits equal the unsharded model's on that prompt alone."""
    config = fp32("smollm2-moe:4:noise=0.02")
    args, full_state = load_weights(config.model, config.cache_dir)
    full = build_model(args, full_state, Precision.fp32(), torch.device("cpu"))
    del full_state
    shards = []
    for rank in range(2):
        ids = expert_range(4, rank, 2)
        _, state = load_weights(config.model, config.cache_dir, None, expert_ids=ids)
        shards.append(build_model(args, state, Precision.fp32(), torch.device("cpu"), expert_ids=ids))
    group = ThreadGroup(2)
    mine = [prompts["p0"], prompts["p1"]]

    def work(rank):
        shards[rank].set_expert_comm(ThreadComm(group, rank))
        return shards[rank].compute_logits(prefill(shards[rank], mine[rank])[-1:])

    for rank, logits in enumerate(run_ranks(2, work)):
        expected = full.compute_logits(prefill(full, mine[rank])[-1:])
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-3)
        assert logits.argmax() == expected.argmax()
