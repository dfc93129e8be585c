"""A seeded random Mixtral checkpoint directory (moe_weights.write_random_mixtral): it loads (all experts, or only
a rank's), serves through the HF directory's tokenizer path, and generates through EngineCore."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from dpserve_shared.schema import EngineRequest, SamplingParams

from dpserve_engine.core import EngineCore
from dpserve_engine.loader import load_hf_dir, load_weights
from dpserve_engine.model import Precision, build_model
from dpserve_engine.model_files import ModelFilesNotFound
from dpserve_engine.model_info import load_model_info
from dpserve_engine.moe_weights import random_mixtral_state, write_random_mixtral
from dpserve_engine.settings import EngineConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("mixtral")
    args = write_random_mixtral(str(path), num_experts=4, top_k=2, seed=5)
    return str(path), args


def config(path: str, **overrides) -> EngineConfig:
    return dataclasses.replace(EngineConfig(model=path, device="cpu", num_kv_blocks=128, block_size=4,
                                            max_num_seqs=8, enforce_eager=True), **overrides)  # fmt: skip


def generate(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(rid, ids, params))
    out = {rid: [] for rid in prompts}
    for _ in range(1000):
        if not core.has_unfinished():
            return out
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    raise AssertionError("the engine did not finish")


def test_checkpoint_is_a_mixtral_directory_with_the_bundled_tokenizer(mixtral_dir):
    path, args = mixtral_dir
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    info = load_model_info(config(path))
    bundled = load_model_info(EngineConfig())
    assert info.tokenizer_json == bundled.tokenizer_json and info.chat_template == bundled.chat_template
    assert info.eos_token_ids == bundled.eos_token_ids and info.vocab_size == args.vocab_size == 49152
    assert info.name == path and info.max_model_len == 1024


def test_checkpoint_loads_and_generates_like_the_in_memory_model(mixtral_dir):
    path, args = mixtral_dir
    loaded_args, state = load_weights(path, "/nonexistent-cache")  # a directory: no cache involved
    assert loaded_args == args
    expected = random_mixtral_state(args, seed=5)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    from_dir = EngineCore(config(path))
    in_memory = EngineCore.from_model(config(path), build_model(args, expected, Precision.fp32(), torch.device("cpu")),
                                      from_dir.model_info)  # fmt: skip
    prompts = {f"p{i}": [(97 * i + 31 * j) % 40000 + 100 for j in range(6 + 5 * i)] for i in range(4)}
    together = generate(from_dir, prompts)
    assert all(len(t) == 8 for t in together.values())
    assert generate(in_memory, prompts) == together
    for rid, ids in prompts.items():  # batched with others or alone: the same greedy tokens
        assert generate(from_dir, {rid: ids})[rid] == together[rid], rid


def test_loading_a_ranks_experts_reads_only_those(mixtral_dir):
    path, args = mixtral_dir
    loaded_args, state = load_hf_dir(path, expert_ids=[2, 3])
    assert loaded_args == args
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in state if ".experts." in k}
    assert experts == {2, 3}
    assert len([k for k in state if ".experts." in k]) == args.n_layers * 2 * 3
    assert all(f"model.layers.{i}.block_sparse_moe.gate.weight" in state for i in range(args.n_layers))
    shard = build_model(args, state, Precision.fp32(), torch.device("cpu"), expert_ids=[2, 3])
    assert shard.expert_ids == [2, 3] and shard.layers[0].feed_forward.w13.shape[0] == 2
    with pytest.raises(KeyError):  # a shard cannot be built for experts it did not load
        build_model(args, state, Precision.fp32(), torch.device("cpu"), expert_ids=[1, 2])
    with pytest.raises(ValueError, match="expert_ids must be distinct, ascending"):
        load_hf_dir(path, expert_ids=[3, 2])


def test_missing_experts_and_dense_expert_ids_are_errors(mixtral_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path, args = mixtral_dir
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text(open(f"{path}/{name}").read())
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFilesNotFound, match=r"experts\.3\.w2"):
        load_hf_dir(str(tmp_path))
    assert load_hf_dir(str(tmp_path), expert_ids=[0, 1])[0] == args  # expert 3 is not this rank's
    with pytest.raises(ValueError, match="a dense model"):
        load_weights("smollm2", "/nonexistent-cache", expert_ids=[0])


def test_moe_decode_step_runs_eagerly_with_one_log_line(mixtral_dir, caplog):
    path, _ = mixtral_dir
    with caplog.at_level(logging.INFO, logger="dpserve_engine.model_runner"):
        core = EngineCore(config(path, enforce_eager=False))
    assert core.runner.compiled is None and core.runner.compile_thread is None
    lines = [r.getMessage() for r in caplog.records if "decode step runs eagerly" in r.getMessage()]
    assert lines == ["MoE model (4 experts, top-2): the decode step runs eagerly (the compiled step covers dense "
                     "models only: per-expert token counts are data-dependent)"]  # fmt: skip
    assert sum(len(t) for t in generate(core, {"r": [100, 200, 300]}).values()) == 8
