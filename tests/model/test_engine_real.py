"""EngineCore on the real SmolLM2-135M (bundled GGUF): correct answers, batching invariance, precision."""

import json
import os

import jinja2.sandbox
import jsonschema
import llguidance
import msgspec
import pytest
import torch
from dpserve_shared.schema import EngineRequest, FinishReason, SamplingParams
from tokenizers import Tokenizer

from dpserve_engine.core import EngineCore, load_model
from dpserve_engine.model import Precision
from dpserve_engine.model_info import load_model_info
from dpserve_engine.settings import EngineConfig
from tests.conftest import TORCH_THREADS

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
    """The production path `auto` chooses for this machine's CPU (cpu_paths.py: q4 on every kind). Under
    test_emulated_kinds.py this module runs again in a process that detects a lesser kind
    (DPSERVE_TEST_EMULATED_KIND): the path, the kernels' ISA and the libraries' caps are that kind's."""
    torch.set_num_threads(TORCH_THREADS)
    core = EngineCore(EngineConfig())
    paths = core.runner.model.kernel_paths
    assert paths.path == "q4" and paths.exact
    assert paths.cpu_kind == os.environ.get("DPSERVE_TEST_EMULATED_KIND", paths.cpu_kind)
    return core


@pytest.fixture(scope="module")
def chat():
    info = load_model_info(EngineConfig())
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(info.chat_template)

    def encode(text: str) -> list[int]:
        rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False).ids

    encode.decode = tokenizer.decode
    return encode


def generate(core, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    return run(core, {rid: EngineRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
                      for rid, ids in prompts.items()})  # fmt: skip


def run(core, requests: dict[str, EngineRequest]) -> dict[str, list[int]]:
    """Every request added at once, stepped to the end: each one's output tokens."""
    for request in requests.values():
        core.add_request(request)
    out = {rid: [] for rid in requests}
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


def test_a_fully_cached_prompt_gives_the_tokens_it_gave_uncached(core, chat):
    """A prompt that fills its last block, sent again: every block is a prefix hit and only its last token runs,
    as a decode row (the decode kernel, not the prefill copy: other last bits in its first logits, and on int4
    bf16 activations). The tokens are the uncached run's, or first differ where its top two were a near tie."""
    for i, text in enumerate(PROMPTS):
        ids = chat(f"{text} (cached {i})")
        ids = ids + ids[-1:] * (-len(ids) % core.block_size)  # the last token ("\n") again to fill the block
        runs = []
        for rid in (f"a{i}", f"b{i}"):
            core.add_request(EngineRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)))
            runs.append([o for _ in range(64) if core.has_unfinished() for o in core.step()])
        uncached, cached = runs
        assert uncached[0].num_cached_tokens < len(ids) - 1 and cached[0].num_cached_tokens == len(ids) - 1
        first = [t for o in uncached for t in o.new_token_ids]
        again = [t for o in cached for t in o.new_token_ids]
        if again != first:
            k = next(k for k, (a, b) in enumerate(zip(first, again)) if a != b)
            top = [lp for o in uncached for lp in o.new_logprobs][k]
            scores = dict(zip(top.top_ids, top.top_logprobs))
            assert again[k] in scores and scores[first[k]] - scores[again[k]] < 0.05, (text, k, scores)


def test_production_precision_matches_fp32_greedy(core, chat):
    """q4 (fp32 activations on the file's weights): fp32's greedy tokens exactly."""
    prompts = {f"p{i}": chat(p) for i, p in enumerate(PROMPTS)}
    production = generate(core, prompts, 32)
    fp32_model = load_model(EngineConfig(quantization="none"), Precision.fp32())  # dequantized, fp32 everywhere
    reference = EngineCore.from_model(EngineConfig(num_kv_blocks=256), fp32_model, core.model_info)
    assert production == generate(reference, prompts, 32)


def test_a_continuation_goes_on_with_the_tokens_the_stream_would_have_had(core, chat):
    """What a migrated stream rests on (README: its rank dies, another rank continues it): the prompt plus the
    first k output tokens, prefilled on a rank that never saw them (no prefix cache), batched with other
    continuations, gives the tokens the stream went on with, greedy and seeded."""
    fresh = EngineCore.from_model(EngineConfig(enable_prefix_caching=False, num_kv_blocks=256), core.runner.model,
                                  core.model_info)  # fmt: skip
    max_tokens = 32

    def params(i: int, n: int) -> SamplingParams:
        seeded = dict(temperature=0.8, seed=1000 + i) if i % 2 else dict(temperature=0.0)
        return SamplingParams(max_tokens=n, ignore_eos=True, **seeded)

    prompts = {f"s{i}": chat(f"Story {i}: once upon a time") for i in range(6)}
    full = run(core, {rid: EngineRequest(rid, ids, params(i, max_tokens)) for i, (rid, ids) in enumerate(prompts.items())})
    continuations = {
        f"{rid}@{k}": EngineRequest(f"{rid}@{k}", ids + full[rid][:k], params(i, max_tokens - k), num_generated=k)
        for k in (3, 17) for i, (rid, ids) in enumerate(prompts.items())
    }  # fmt: skip
    went_on = run(fresh, continuations)
    for cid, tokens in went_on.items():
        rid, k = cid.split("@")
        assert tokens == full[rid][int(k):], cid


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_output_is_valid_and_the_same_alone_in_a_mixed_batch_and_continued(core, chat):
    """Structured outputs (grammar.py): a greedy and a seeded (temperature 1) request under a JSON schema give JSON
    valid for it, and the same tokens alone, in a batch with other constrained and unconstrained requests (whose
    rows the masks leave alone), and continued after k tokens on a rank that never saw them."""
    g = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    digits, broken = (llguidance.LLMatcher.grammar_from_regex(r) for r in ("[0-9]{2,6}", "(["))
    prompt = chat("Describe a person named Alice who is 30 years old, as JSON.")
    # the batch finds its blocks cached; a prompt filling its last block would run its last token as a decode row,
    # which may swap near ties (test_a_fully_cached_prompt_gives_the_tokens_it_gave_uncached)
    assert len(prompt) % core.block_size
    targets = {"greedy": SamplingParams(temperature=0.0, max_tokens=64, grammar=g),
               "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=64, grammar=g)}  # fmt: skip
    alone = {rid: run(core, {rid: EngineRequest(rid, prompt, p)})[rid] for rid, p in targets.items()}
    for tokens in alone.values():
        jsonschema.validate(json.loads(chat.decode(tokens)), PERSON)
    others = {
        "plain": (chat(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=16)),
        "plain-seeded": (chat(PROMPTS[1]), SamplingParams(temperature=0.8, seed=3, max_tokens=16)),
        "plain-top-p": (chat(PROMPTS[2]), SamplingParams(top_p=0.9, max_tokens=16)),
        "json": (chat("Describe Bob, who is 41, as JSON."), SamplingParams(temperature=0.0, max_tokens=48, grammar=g)),
        "digits": (chat("Pick a number."), SamplingParams(seed=5, max_tokens=8, grammar=digits)),
        "broken": (chat(PROMPTS[3]), SamplingParams(max_tokens=8, grammar=broken)),
    }  # fmt: skip
    batch = {rid: EngineRequest(rid, prompt, p) for rid, p in targets.items()}
    batch.update((rid, EngineRequest(rid, ids, p)) for rid, (ids, p) in others.items())
    for request in batch.values():
        core.add_request(request)
    outputs = [o for _ in range(200) if core.has_unfinished() for o in core.step()]
    together = {rid: [t for o in outputs if o.request_id == rid for t in o.new_token_ids] for rid in batch}
    assert {rid: together[rid] for rid in targets} == alone
    assert together["plain"] == generate(core, {"x": others["plain"][0]}, 16)["x"]
    jsonschema.validate(json.loads(chat.decode(together["json"])), PERSON)
    assert [o.finish_reason for o in outputs if o.request_id == "broken"] == [FinishReason.ERROR]
    fresh = EngineCore.from_model(EngineConfig(enable_prefix_caching=False, num_kv_blocks=256), core.runner.model,
                                  core.model_info)  # fmt: skip
    k = 5
    continued = {rid: msgspec.structs.replace(p, max_tokens=64 - k) for rid, p in targets.items()}
    went_on = run(fresh, {rid: EngineRequest(rid, prompt + alone[rid][:k], p, num_generated=k)
                          for rid, p in continued.items()})  # fmt: skip
    assert went_on == {rid: tokens[k:] for rid, tokens in alone.items()}


def test_dequantized_fp32_answers_the_capital_of_france(chat):
    """quantization="none": the GGUF dequantized to fp32 (the reference above, as an engine of its own)."""
    dequantized = EngineCore(EngineConfig(device="cpu", quantization="none", num_kv_blocks=64))
    tokens = generate(dequantized, {"france": chat(PROMPTS[0])}, 24)["france"]
    assert "Paris" in chat.decode(tokens)


@pytest.fixture(scope="module")
def compiled_core():
    """The default engine outside the test suite: the decode step compiled (compiled.py). A cold inductor cache
    costs ~2 minutes here; later runs reuse <cache_dir>/inductor."""
    torch.set_num_threads(TORCH_THREADS)
    return EngineCore(EngineConfig(enforce_eager=False, max_num_seqs=16))


@pytest.mark.timeout(900)
def test_compiled_decode_step_is_batch_invariant_and_matches_fp32(compiled_core, chat):
    """Greedy tokens of the compiled path (one graph for every batch size, prefill rows eager beside it): the
    same alone as 16 at once with prompts of different lengths joining mid-decode, and the fp32 reference's."""
    compiled = compiled_core.runner.compiled
    assert compiled is not None
    many = {f"c{i}": chat(f"{PROMPTS[i % 5]} (variant {i})" * (1 + i % 3)) for i in range(16)}
    together = generate(compiled_core, many, 24)
    for rid, ids in many.items():
        assert generate(compiled_core, {rid: ids}, 24)[rid] == together[rid], rid
    prompts = {f"p{i}": chat(p) for i, p in enumerate(PROMPTS)}
    fp32_model = load_model(EngineConfig(quantization="none"), Precision.fp32())
    reference = EngineCore.from_model(EngineConfig(num_kv_blocks=256), fp32_model, compiled_core.model_info)
    # allowed only where fp32 itself nearly ties (fused kernels round otherwise)
    assert_equal_but_near_ties(generate(compiled_core, prompts, 32), generate(reference, prompts, 32), prompts, reference)
    assert compiled.num_calls > 0 and compiled.num_fallbacks == 0


def assert_equal_but_near_ties(ours: dict, theirs: dict, prompts: dict, reference) -> None:
    """Each request's greedy tokens equal the fp32 reference's, or first differ where the reference's top two
    logprobs are within 0.05 of each other (a near tie that a rounding difference may swap)."""
    for rid, ids in prompts.items():
        if ours[rid] != theirs[rid]:
            i = next(i for i, (a, b) in enumerate(zip(ours[rid], theirs[rid])) if a != b)
            top = fp32_top_logprobs(reference, ids + theirs[rid][:i])
            assert ours[rid][i] in top and top[theirs[rid][i]] - top[ours[rid][i]] < 0.05, (rid, i, top)


def fp32_top_logprobs(core, ids: list[int]) -> dict[int, float]:
    """The top-5 next-token logprobs after `ids`."""
    core.add_request(EngineRequest("top", ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)))
    outputs = [o for _ in range(len(ids) + 1) if core.has_unfinished() for o in core.step()]
    entry = outputs[-1].new_logprobs[0]
    return dict(zip(entry.top_ids, entry.top_logprobs))
