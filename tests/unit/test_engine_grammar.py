"""Structured outputs in the engine (grammar.py), through the null engine with the bundled model's real tokenizer:
each of its tokens is a random draw among those the grammar allows, so whatever it emits must match the grammar."""

import json
import re
import threading

import jsonschema
import llguidance
import pytest
from dpserve_shared.schema import EngineRequest, FinishReason, ModelInfo, SamplingParams
from tokenizers import Tokenizer

from dpserve_engine import grammar
from dpserve_engine.grammar import GrammarCompiler, disallowed_tokens
from dpserve_engine.interface import InvalidRequest
from dpserve_engine.null_core import NullEngineCore

pytestmark = pytest.mark.timeout(60)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
# compact JSON: the null engine's random draws would otherwise pad with whitespace until max_tokens
PERSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})
CHOICES = ["yes", "no", "maybe"]
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def core(model_info):
    return NullEngineCore(model_info)


@pytest.fixture(scope="module")
def tokenizer(model_info):
    return Tokenizer.from_str(model_info.tokenizer_json)


@pytest.fixture(scope="module")
def decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # an EOS the grammar allowed is dropped


def run(core, requests: list[EngineRequest]) -> dict[str, tuple[list[int], object]]:
    """Every request added at once, stepped to the end: each one's (tokens, last output)."""
    for request in requests:
        core.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    last = {}
    while core.has_unfinished():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            last[output.request_id] = output
    return {rid: (tokens[rid], last[rid]) for rid in tokens}


def constrained(grammar_text: str, max_tokens: int = 64, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, grammar=grammar_text, **kwargs)


def test_json_schema_regex_and_choice_outputs_match_their_grammar(core, decode):
    checks = {
        "json": (PERSON_GRAMMAR,
                 lambda text: jsonschema.validate(json.loads(text), PERSON)),
        "regex": (llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2}"),
                  lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) or pytest.fail(text)),
        "digits": (llguidance.LLMatcher.grammar_from_regex(r"[0-9]{1,6}"),  # may end with EOS before 6 digits
                   lambda text: re.fullmatch(r"[0-9]{1,6}", text) or pytest.fail(text)),
        "choice": (llguidance.grammar_from("choice", CHOICES),
                   lambda text: text in CHOICES or pytest.fail(text)),
    }  # fmt: skip
    requests = [EngineRequest(f"{kind}-{seed}", PROMPT, constrained(g, seed=seed))
                for kind, (g, _) in checks.items() for seed in range(6)]  # fmt: skip
    results = run(core, requests)
    for rid, (tokens, last) in results.items():
        assert last.finish_reason == FinishReason.STOP, (rid, last)
        checks[rid.split("-")[0]][1](decode(tokens))
    texts = {decode(results[f"regex-{seed}"][0]) for seed in range(6)}
    assert len(texts) > 1  # draws, not one fixed answer


def test_a_seeded_request_repeats_and_a_continuation_goes_on_with_its_tokens(core):
    """By seed, else by request id; a continuation (its first k tokens in the prompt, num_generated=k) replays
    them into its matcher and its generator, and goes on as the stream would have."""
    g = PERSON_GRAMMAR
    (full, _), (again, _) = run(core, [EngineRequest("a", PROMPT, constrained(g, seed=3)),
                                       EngineRequest("b", PROMPT, constrained(g, seed=3))]).values()  # fmt: skip
    assert full == again and len(full) > 5
    (by_id, _), = run(core, [EngineRequest("same-id", PROMPT, constrained(g))]).values()
    (by_id_again, _), = run(core, [EngineRequest("same-id", PROMPT, constrained(g))]).values()
    assert by_id == by_id_again
    continuations = [EngineRequest(f"a@{k}", PROMPT + full[:k], constrained(g, 64 - k, seed=3), num_generated=k)
                     for k in (1, 5)]  # fmt: skip
    for request, (rest, last) in zip(continuations, run(core, continuations).values()):
        assert rest == full[request.num_generated :] and last.finish_reason == FinishReason.STOP


def test_grammar_failures_end_with_an_error_naming_the_cause(core, tokenizer):
    broken = llguidance.LLMatcher.grammar_from_regex("([")
    digits = llguidance.LLMatcher.grammar_from_regex("[0-9]{3}")
    off_grammar = tokenizer.encode("ab", add_special_tokens=False).ids
    results = run(core, [
        EngineRequest("broken", PROMPT, constrained(broken)),
        EngineRequest("broken-again", PROMPT, constrained(broken)),  # from the cache
        EngineRequest("moved", PROMPT + off_grammar, constrained(digits), num_generated=len(off_grammar)),
    ])  # fmt: skip
    for rid, (tokens, last) in results.items():
        assert tokens == [] and last.finish_reason == FinishReason.ERROR, rid
    assert "does not compile" in results["broken"][1].error and "regex" in results["broken-again"][1].error
    assert "earlier output tokens do not satisfy its grammar" in results["moved"][1].error


def test_a_grammar_contradicted_by_min_tokens_or_ignore_eos_is_invalid(core):
    g = llguidance.LLMatcher.grammar_from_regex("[0-9]{3}")
    for named, value in (("min_tokens", 2), ("ignore_eos", True)):
        with pytest.raises(InvalidRequest, match=named):
            core.add_request(EngineRequest("bad", PROMPT, constrained(g, **{named: value})))
    assert not core.has_unfinished()


@pytest.fixture
def held_compiles(monkeypatch):
    """Compiles wait until the test sets the event (set again at teardown: no thread is left waiting)."""
    release = threading.Event()
    compile_now = GrammarCompiler._compile

    def held(self, grammar_text, replay):
        release.wait(30)
        return compile_now(self, grammar_text, replay)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)
    yield release
    release.set()


def test_a_compiling_request_holds_up_nobody_counts_as_waiting_and_can_be_aborted(model_info, held_compiles):
    core = NullEngineCore(model_info)
    core.add_request(EngineRequest("held", PROMPT, constrained(llguidance.LLMatcher.grammar_from_regex("[0-9]+"))))
    core.add_request(EngineRequest("plain", PROMPT, SamplingParams(max_tokens=2)))
    assert core.load().num_waiting == 2
    with pytest.raises(InvalidRequest, match="duplicate"):
        core.add_request(EngineRequest("held", PROMPT, SamplingParams(max_tokens=2)))
    results = run_until(core, lambda outputs: "plain" in outputs and outputs["plain"].finish_reason is not None)
    assert results["plain"].finish_reason == FinishReason.LENGTH and "held" not in results
    assert core.has_unfinished() and core.load().num_waiting == 1
    (aborted,) = core.abort(["held"])
    assert aborted.finish_reason == FinishReason.ABORT and not core.has_unfinished()


def test_a_compile_slower_than_the_timeout_ends_with_an_error(model_info, held_compiles):
    core = NullEngineCore(model_info, grammar_compile_timeout_s=0.05)
    core.add_request(EngineRequest("slow", PROMPT, constrained(llguidance.LLMatcher.grammar_from_regex("[0-9]+"))))
    results = run_until(core, lambda outputs: not core.has_unfinished())
    assert results["slow"].finish_reason == FinishReason.ERROR
    assert "--grammar-compile-timeout-s 0.05" in results["slow"].error


def run_until(core, done, max_steps: int = 10_000) -> dict:
    """Step until done(last output by request id); the idle steps wait a few ms each for the compiles."""
    outputs = {}
    for _ in range(max_steps):
        outputs.update((o.request_id, o) for o in core.step())
        if done(outputs):
            return outputs
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def test_an_engine_without_a_usable_tokenizer_errors_then_refuses_grammars():
    info = ModelInfo(name="null", root="-", max_model_len=256, vocab_size=2000, tokenizer_json="{}")
    core = NullEngineCore(info)
    g = llguidance.LLMatcher.grammar_from_regex("[0-9]+")
    (_, first), = run(core, [EngineRequest("first", PROMPT, constrained(g))]).values()
    assert first.finish_reason == FinishReason.ERROR and "tokenizer" in first.error
    with pytest.raises(InvalidRequest, match="structured outputs need the model's tokenizer"):
        core.add_request(EngineRequest("second", PROMPT, constrained(g)))
    (plain, _), = run(core, [EngineRequest("plain", PROMPT, SamplingParams(max_tokens=3))]).values()
    assert len(plain) == 3


def test_one_compile_per_grammar_and_the_mask_covers_only_constrained_rows(model_info, monkeypatch, decode):
    num_compiles = []
    matcher_class = llguidance.LLMatcher

    def counting(tokenizer, grammar_text, **kwargs):
        num_compiles.append(grammar_text)  # earlier tests' held compiles may still end now: counted apart
        return matcher_class(tokenizer, grammar_text, **kwargs)

    monkeypatch.setattr(grammar.llguidance, "LLMatcher", counting)
    compiler = GrammarCompiler(model_info.tokenizer_json, model_info.vocab_size, model_info.eos_token_ids)
    g = matcher_class.grammar_from_regex("[0-9]{2}")
    first = compiler.submit(g, []).result(timeout=30)
    second = compiler.submit(g, []).result(timeout=30)  # from the cache
    assert num_compiles.count(g) == 1
    assert first.consume(first.allowed_token_ids()[0]) is None  # one digit in: second is still at the start
    mask = disallowed_tokens([(1, second)], 3, model_info.vocab_size)
    assert mask.shape == (3, model_info.vocab_size) and not mask[0].any() and not mask[2].any()
    allowed = (~mask[1]).nonzero()[0]
    assert allowed.tolist() == second.allowed_token_ids().tolist()
    assert sorted(decode([t]) for t in allowed) == [str(d) for d in range(10)]


def test_masks_filled_on_threads_equal_the_serial_ones(model_info):
    """disallowed_tokens fills several rows on llguidance's threads: the same bits as row by row, and rows
    without a grammar allow everything."""

    compiler = GrammarCompiler(model_info.tokenizer_json, model_info.vocab_size, model_info.eos_token_ids)
    matchers = [compiler.submit(llguidance.LLMatcher.grammar_from_regex(regex), []).result(timeout=30)
                for regex in ("[0-9]{2}", "(yes|no)", "[a-z ]{40}")]
    rows = [(0, matchers[0]), (2, matchers[1]), (3, matchers[2])]
    serial = ~disallowed_tokens(rows, 5, model_info.vocab_size, num_threads=1)
    threaded = ~disallowed_tokens(rows, 5, model_info.vocab_size, num_threads=2)
    assert (serial == threaded).all()
    assert serial[1].all() and serial[4].all() and not serial[0].all()
    assert serial[0].sum() < serial[3].sum()  # two digits allow fewer tokens than lower-case words
