"""EngineCore on the real SmolLM2-135M (bundled GGUF): correct answers, batching invariance, precision."""

import jinja2.sandbox
import pytest
import torch
from dpserve_shared.schema import EngineRequest, SamplingParams
from tokenizers import Tokenizer

from dpserve_engine.config import EngineConfig
from dpserve_engine.core import EngineCore, load_model
from dpserve_engine.model import Precision

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "What is 2+2? Answer briefly.",
    "Name three primary colors.",
    "Give me one tip for writing clean code.",
]


@pytest.fixture(scope="module")
def core():
    torch.set_num_threads(2)
    return EngineCore(EngineConfig())  # the production precision of this machine's device


@pytest.fixture(scope="module")
def chat(core):
    info = core.model_info
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(info.chat_template)

    def encode(text: str) -> list[int]:
        rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False).ids

    encode.decode = tokenizer.decode
    return encode


def generate(core, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        core.add_request(EngineRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    out = {rid: [] for rid in prompts}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_answers_the_capital_of_france(core, chat):
    tokens = generate(core, {"france": chat(PROMPTS[0])}, 24)["france"]
    assert "Paris" in chat.decode(tokens)


def test_16_concurrent_requests_equal_each_alone(core, chat):
    prompts = {f"c{i}": chat(f"{PROMPTS[i % 5]} (variant {i})") for i in range(16)}
    together = generate(core, prompts, 12)
    for rid, ids in prompts.items():
        assert generate(core, {rid: ids}, 12)[rid] == together[rid], rid


def test_production_precision_matches_fp32_greedy(core, chat):
    prompts = {f"p{i}": chat(p) for i, p in enumerate(PROMPTS)}
    production = generate(core, prompts, 32)
    fp32_model = load_model(EngineConfig(quantization="none"), Precision.fp32())  # dequantized, fp32 everywhere
    reference = EngineCore.from_model(EngineConfig(num_kv_blocks=256), fp32_model, core.model_info)
    assert generate(reference, prompts, 32) == production


def test_dequantized_fp32_answers_the_capital_of_france(core, chat):
    """quantization="none": the GGUF dequantized to fp32 (the reference above, as an engine of its own)."""
    dequantized = EngineCore(EngineConfig(device="cpu", quantization="none", num_kv_blocks=64))
    tokens = generate(dequantized, {"france": chat(PROMPTS[0])}, 24)["france"]
    assert "Paris" in chat.decode(tokens)
