"""EngineCore end to end on a tiny random-weight model (2 layers, dim 64, vocab 300): milliseconds per test."""

import dataclasses
import os
import re
import sys

import msgspec

import pytest
import torch
from dpserve_shared.schema import EngineRequest, FinishReason, ModelInfo, SamplingParams

from dpserve_engine.settings import EngineConfig
from dpserve_engine.core import EngineCore
from dpserve_engine.interface import InvalidRequest
from dpserve_engine.model import ModelArgs, Precision, build_model

pytestmark = pytest.mark.timeout(60)
VOCAB, EOS = 300, 2
ARGS = ModelArgs(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256, tie_embeddings=False)
INFO = ModelInfo(name="tiny", root="memory", max_model_len=256, vocab_size=VOCAB, tokenizer_json="", eos_token_ids=[EOS])
BASE = EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(ARGS, None, Precision.fp32(), torch.device("cpu"))


def engine(model, **overrides):
    return EngineCore.from_model(dataclasses.replace(BASE, **overrides), model, INFO)


def prompt(i, n=12):
    return [(31 * i + 7 * j) % (VOCAB - 20) + 20 for j in range(n)]  # avoid EOS


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(core, requests):
    """Add (id, prompt, params) requests, step to the end; -> {id: [outputs]}."""
    for rid, ids, params in requests:
        core.add_request(EngineRequest(rid, ids, params))
    outputs = {}
    for _ in range(10_000):
        if not core.has_unfinished():
            return outputs
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens(outputs):
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def solo(model, rid, ids, params, **overrides):
    return tokens(run(engine(model, **overrides), [(rid, ids, params)]))[rid]


def test_concurrent_equals_alone_and_budgets_hold(model):
    core = engine(model, max_num_batched_tokens=16, max_num_seqs=3)
    batches = []
    original = core.runner.run
    core.runner.run = lambda batch: (batches.append(list(batch.num_tokens)), original(batch))[1]
    requests = [(f"r{i}", prompt(i, 5 + 4 * i), greedy(6)) for i in range(6)]
    together = tokens(run(core, requests))
    assert all(sum(b) <= 16 and len(b) <= 3 for b in batches)
    assert any(len(b) > 1 and max(b) > 1 and min(b) == 1 for b in batches)  # decodes mixed with prefill chunks
    for rid, ids, params in requests:
        assert together[rid] == solo(model, rid, ids, params), rid
    assert core.load().kv_blocks_used == 0


def test_chunked_prefill_completes_and_matches_one_chunk(model):
    ids = prompt(3, 70)
    assert solo(model, "c", ids, greedy(), max_num_batched_tokens=8) == solo(model, "c", ids, greedy(), max_num_batched_tokens=128)


def test_prefix_hits_after_a_repeated_prompt(model):
    core = engine(model)
    ids = prompt(5, 23)
    first = run(core, [("a", ids, greedy())])["a"]
    second = run(core, [("b", ids, greedy())])["b"]
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 20
    assert second[0].num_prompt_tokens == 23
    assert tokens({"a": first})["a"] == tokens({"b": second})["b"]
    load = core.load()
    assert load.prefix_queries == 46 and load.prefix_hits == 20


def test_a_fully_cached_prompt_recomputes_only_its_last_token(model):
    """A prompt that fills its last block, sent again: every block is shared and only the last token runs (as a
    decode row whose K/V is not written: the shared block holds it); same tokens as the first time, and the
    shared blocks' K/V is not touched. Four at once: the first computes the prompt, the others wait a step and
    share it all."""
    core = engine(model)
    ids = prompt(6, 24)  # 6 blocks of 4
    first = run(core, [("a", ids, greedy())])["a"]
    blocks = core.scheduler.block_manager.cached_free.copy()
    k_before = [k.clone() for k, _ in core.runner.kv_caches]
    batches = []
    original = core.runner.run
    core.runner.run = lambda batch: (batches.append(list(batch.num_tokens)), original(batch))[1]
    second = run(core, [("b", ids, greedy())])["b"]
    assert batches[0] == [1]  # one token computed, not a block
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 23
    assert tokens({"a": first})["a"] == tokens({"b": second})["b"]
    bs = core.runner.block_size
    for (k, _), before in zip(core.runner.kv_caches, k_before):
        for block in blocks:
            assert torch.equal(k[:, block * bs : (block + 1) * bs], before[:, block * bs : (block + 1) * bs])
    together = tokens(run(core, [(f"c{i}", ids, greedy()) for i in range(4)]))
    assert all(t == tokens({"a": first})["a"] for t in together.values())
    load = core.load()
    assert load.kv_blocks_used == 0 and load.prefix_hits == 23 * 5


def test_preemption_and_resume_give_the_unpreempted_output(model):
    requests = [(f"p{i}", prompt(i, 10), greedy(20)) for i in range(4)]
    roomy = tokens(run(engine(model), requests))
    core = engine(model, num_kv_blocks=16)  # 4 x 30 tokens need 32 blocks of 4
    tight = tokens(run(core, requests))
    assert core.load().num_preemptions > 0
    assert tight == roomy
    assert core.load().kv_blocks_used == 0


def test_abort_frees_every_block(model):
    core = engine(model, enable_prefix_caching=False)
    for i in range(5):
        core.add_request(EngineRequest(f"x{i}", prompt(i, 9), greedy(50)))
    for _ in range(4):
        core.step()
    assert core.load().kv_blocks_used > 0
    outs = core.abort([f"x{i}" for i in range(5)] + ["unknown"])
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT] * 5
    assert core.load().kv_blocks_used == 0 and not core.has_unfinished()


def test_max_queue_time_ends_requests_that_waited_too_long_unscheduled(model):
    core = engine(model, max_num_seqs=1, max_queue_time_s=30.0)
    core.add_request(EngineRequest("running", prompt(0), greedy(20)))
    core.step()  # "running" takes the only slot
    core.add_request(EngineRequest("stale", prompt(1), greedy(4)))
    core.add_request(EngineRequest("fresh", prompt(2), greedy(4)))
    core.requests["stale"].arrival_s -= 60.0  # as if it had waited a minute (no clock in unit tests)
    outs = core.step()
    expired = [o for o in outs if o.request_id == "stale"]
    assert len(expired) == 1 and expired[0].finish_reason == FinishReason.ERROR
    assert expired[0].retry_reason == "queue_time" and "--max-queue-time-s 30" in expired[0].error
    assert expired[0].queue_time_s >= 60.0
    assert "stale" not in core.requests and core.load().num_waiting == 1  # "fresh" still waits
    finished = run(core, [])
    assert finished["fresh"][-1].finish_reason == FinishReason.LENGTH
    assert finished["fresh"][0].retry_reason is None


def test_seeded_sampling_is_batch_independent(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = solo(model, "s", prompt(1), params)
    others = [(f"o{i}", prompt(i + 2), SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)) for i in range(4)]
    together = tokens(run(engine(model), others + [("s", prompt(1), params)]))
    assert together["s"] == alone


@pytest.mark.parametrize("params", [
    greedy(14, min_tokens=9),
    SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=14, min_tokens=9, ignore_eos=True),
], ids=["greedy", "seeded"])  # fmt: skip
def test_a_continuation_gives_the_tokens_of_the_uninterrupted_request(model, params):
    """What a frontend sends for a request whose rank died after k tokens (engine_pool.continuation): the prompt
    plus those k tokens, the rest of the budgets, seeded draws from output position k on. The rank it lands on
    produces exactly the tokens the request would have produced without the move."""
    from dpserve_frontend.engine_pool import continuation

    whole = solo(model, "m", prompt(3), params)
    assert len(whole) == 14
    for k in (1, 6, 13):
        first = EngineRequest("m", prompt(3), params)
        moved = continuation(continuation(first, whole[: k // 2]), whole[k // 2 : k])  # moved twice
        assert moved.num_generated == k and moved.sampling.max_tokens == 14 - k
        assert moved.sampling.min_tokens == max(0, 9 - k)
        core = engine(model)
        core.add_request(moved)
        rest = []
        while core.has_unfinished():
            rest += [t for out in core.step() for t in out.new_token_ids]
        assert whole[:k] + rest == whole, k


def test_logprobs_and_prompt_logprobs_shapes(model):
    ids = prompt(4, 9)
    outs = run(engine(model), [("l", ids, greedy(5, logprobs=3, prompt_logprobs=2))])["l"]
    assert all(len(o.new_logprobs) == 1 and len(o.new_logprobs[0].top_ids) == 3 for o in outs)
    assert all(o.new_logprobs[0].rank == 1 and o.new_logprobs[0].top_ids[0] == o.new_token_ids[0] for o in outs)
    plp = outs[0].prompt_logprobs
    assert len(plp) == 9 and plp[0] is None
    assert [p.token_id for p in plp[1:]] == ids[1:] and all(len(p.top_ids) == 2 for p in plp[1:])
    assert outs[1].prompt_logprobs is None
    chunked = run(engine(model, max_num_batched_tokens=4, max_num_seqs=4), [("l", ids, greedy(5, logprobs=3, prompt_logprobs=2))])["l"]
    assert [p.token_id for p in chunked[0].prompt_logprobs[1:]] == ids[1:]
    assert chunked[0].prompt_logprobs[3].logprob == pytest.approx(plp[3].logprob, abs=1e-4)


def test_stop_token_ids_and_min_tokens(model):
    ids = prompt(6)
    free = solo(model, "f", ids, greedy(8))
    stop_at = free[2]
    first = free.index(stop_at)
    outs = run(engine(model), [("s", ids, greedy(8, stop_token_ids=[stop_at]))])["s"]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop_at
    assert len(outs) == first + 1
    held = run(engine(model), [("m", ids, greedy(8, stop_token_ids=[stop_at], min_tokens=first + 2))])["m"]
    assert stop_at not in [t for o in held[: first + 2] for t in o.new_token_ids]
    assert len(held) >= first + 2


def test_eos_finishes_with_stop_unless_ignored(model):
    ids = prompt(7)
    first_token = solo(model, "f", ids, greedy(1))[0]
    info = msgspec.structs.replace(INFO, eos_token_ids=[first_token])
    core = EngineCore.from_model(BASE, model, info)
    outs = run(core, [("e", ids, SamplingParams(temperature=0, max_tokens=5))])["e"]
    assert len(outs) == 1 and outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason is None
    outs = run(core, [("i", ids, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))])["i"]
    assert len(outs) == 5 and outs[-1].finish_reason == FinishReason.LENGTH
    outs = run(core, [("n", ids, SamplingParams(temperature=0, max_tokens=5, min_tokens=3))])["n"]
    assert len(outs) >= 3 and first_token not in [o.new_token_ids[0] for o in outs[:3]]


@pytest.mark.parametrize(
    "ids, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([5] * 250, SamplingParams(max_tokens=10), "250"),
        ([5, VOCAB], SamplingParams(), "[0, 300)"),
        ([5, -1], SamplingParams(), "[0, 300)"),
    ],
)
def test_invalid_requests(model, ids, params, message):
    with pytest.raises(InvalidRequest, match=None) as info:
        engine(model).add_request(EngineRequest("bad", ids, params))
    assert message in str(info.value)
    if message == "250":
        assert "256" in str(info.value) and "10" in str(info.value)


@pytest.mark.timeout(300)
def test_compiled_decode_step_gives_the_eager_tokens(model, tmp_path):
    """The compiled decode graph (one graph for every batch size and context length, padded rows on the scratch
    block) against eager PyTorch on the same requests: 1 then 6 at once, contexts crossing many blocks, prefills
    joining mid-decode. The tiny model's logits are far apart, so greedy tokens must be equal. Up to 3 rows run
    the serial-kernel graph here, more the parallel one, so a request's tokens cross both. Steps call the graphs
    directly (DirectCall); the guarded torch.compile call, used when that cannot be set up, is checked too."""
    requests = [(f"r{i}", prompt(i, 3 + 5 * i), greedy(max_tokens=20 + 3 * i)) for i in range(6)]
    compiled_core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path))  # traced, not loaded
    compiled = compiled_core.runner.compiled
    assert compiled is not None and all(graph.direct is not None and graph.traced for graph in compiled.graphs)
    compiled.serial_max_rows = 3
    calls = lambda: [graph.direct.num_calls for graph in compiled.graphs]  # noqa: E731
    before = calls()
    alone = solo(model, "r0", *requests[0][1:])
    assert tokens(run(compiled_core, requests[:1])) == {"r0": alone}
    assert tokens(run(compiled_core, requests)) == tokens(run(engine(model), requests))
    assert all(after > n for after, n in zip(calls(), before))  # both graphs ran
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3 - threads if threads <= 2 else 1)  # as the engine does with load (threads.py)
        assert tokens(run(compiled_core, requests[:2])) == tokens(run(engine(model), requests[:2]))
    finally:
        torch.set_num_threads(threads)
    directs = [graph.direct for graph in compiled.graphs]
    try:
        for graph in compiled.graphs:
            graph.direct = None
        assert tokens(run(compiled_core, requests[:5])) == tokens(run(engine(model), requests[:5]))
    finally:
        for graph, direct in zip(compiled.graphs, directs):
            graph.direct = direct
    aligned = prompt(7, 16)  # fills its last block: sent again, its last token is a compiled decode row
    eager = solo(model, "x", aligned, greedy())
    assert tokens(run(compiled_core, [("x", aligned, greedy())]))["x"] == eager
    again = run(compiled_core, [("y", aligned, greedy())])["y"]
    assert again[0].num_cached_tokens == 15 and tokens({"y": again})["y"] == eager
    assert compiled.num_calls > 0 and compiled.num_fallbacks == 0


def fresh_cache_dir(tmp_path) -> str:
    """A cache dir with no saved decode step; the C++ kernels come from the default one (built once a machine)."""
    from dpserve_engine import kernels

    kernels.load(EngineConfig().cache_dir)
    return str(tmp_path)


@pytest.mark.timeout(180)
def test_saved_decode_step_loads_without_tracing_and_gives_the_same_tokens(model, tmp_path, caplog):
    """A traced warm-up saves the step (precompiled.py); the next engine on that cache dir loads it without
    tracing and decodes the same tokens. A saved step that does not check out (here its probe) is not used: the
    engine traces as before. A direct call that raises sends that step, and the graph's later ones, elsewhere."""
    import json
    import logging

    caplog.set_level(logging.INFO, logger="dpserve_engine")
    cache_dir = fresh_cache_dir(tmp_path)
    requests = [(f"r{i}", prompt(i, 3 + 4 * i), greedy(max_tokens=12 + 2 * i)) for i in range(4)]
    eager = tokens(run(engine(model), requests))

    first = engine(model, enforce_eager=False, cache_dir=cache_dir)
    assert all(graph.traced for graph in first.runner.compiled.graphs)
    manifests = list((tmp_path / "decode").glob("*/manifest.json"))
    assert len(manifests) == 1 and "later starts load it without tracing" in caplog.text
    assert tokens(run(first, requests)) == eager

    caplog.clear()
    second = engine(model, enforce_eager=False, cache_dir=cache_dir)
    compiled = second.runner.compiled
    assert compiled is not None and all(not g.traced and g.direct is not None for g in compiled.graphs)
    assert "(no tracing)" in caplog.text and "preparing the compiled decode step" not in caplog.text
    compiled.serial_max_rows = 2  # both graphs take steps
    calls = [g.direct.num_calls for g in compiled.graphs]
    assert tokens(run(second, requests)) == eager
    assert all(g.direct.num_calls > n for g, n in zip(compiled.graphs, calls))
    assert compiled.num_fallbacks == 0

    # a direct call that fails: that step and the graph's later ones run eagerly (loaded: no guarded call)
    def broken(args):
        raise RuntimeError("entry point gone")

    compiled.serial.direct._fn = broken
    assert tokens(run(second, requests[:1])) == {"r0": eager["r0"]}
    assert compiled.serial.direct is None and compiled.num_fallbacks > 0
    assert "the direct call failed" in caplog.text

    manifest = json.loads(manifests[0].read_text())
    manifest["graphs"]["serial"]["probe"] = "0" * 64
    manifests[0].write_text(json.dumps(manifest))
    caplog.clear()
    third = engine(model, enforce_eager=False, cache_dir=cache_dir)
    assert "is not usable" in caplog.text and "probe differs" in caplog.text
    assert all(graph.traced for graph in third.runner.compiled.graphs)
    assert tokens(run(third, requests)) == eager


@pytest.mark.timeout(120)
def test_preparing_the_decode_step_reports_its_phase(model, tmp_path, monkeypatch, caplog):
    """A progress line at least every PROGRESS_INTERVAL_S while the step is prepared (here every 50 ms, with the
    warm-up held 0.3 s in its first phase: in this process the tiny model's graphs may already be traced):
    minutes of silence at start-up look like a hang."""
    import logging
    import time

    from dpserve_engine import model_runner
    from dpserve_engine.compiled import CompiledDecode

    original = CompiledDecode.warm_up

    def slow_warm_up(self, prepare):
        self.phase = "tracing and compiling the serial graph"
        time.sleep(0.3)
        original(self, prepare)

    caplog.set_level(logging.INFO, logger="dpserve_engine")
    monkeypatch.setattr(model_runner, "PROGRESS_INTERVAL_S", 0.05)
    monkeypatch.setattr(CompiledDecode, "warm_up", slow_warm_up)
    core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path))
    assert core.runner.compiled is not None
    lines = [r.getMessage() for r in caplog.records if "s so far (decode runs eagerly meanwhile)" in r.getMessage()]
    assert any(line.startswith("decode step: tracing and compiling the serial graph, ") for line in lines)


@pytest.mark.timeout(180)
def test_compiled_path_fails_safe(model, tmp_path, monkeypatch, caplog):
    """The direct call reads torch internals. Whatever goes wrong there, requests get the eager tokens: a capture
    that raises something unexpected (here an attribute torch no longer has) and a torch version the direct call
    was not checked on leave the steps to torch.compile's guarded call (one warning); a guarded call that raises
    sends that graph's steps to the eager path from then on."""
    from dpserve_engine import compiled as compiled_module
    from dpserve_engine.direct_call import DirectCall

    requests = [(f"r{i}", prompt(i, 3 + 4 * i), greedy(max_tokens=10 + 2 * i)) for i in range(4)]
    eager = tokens(run(engine(model), requests))

    def no_attribute(*args, **kwargs):
        raise AttributeError("'CompiledFxGraph' object has no attribute 'current_callable'")

    with monkeypatch.context() as m:
        m.setattr(DirectCall, "capture", staticmethod(no_attribute))
        core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path / "a"))
    compiled = core.runner.compiled
    assert compiled is not None and all(graph.direct is None for graph in compiled.graphs)
    assert "no direct call (AttributeError" in caplog.text
    assert tokens(run(core, requests)) == eager and compiled.num_fallbacks == 0

    caplog.clear()
    with monkeypatch.context() as m:
        m.setattr(compiled_module, "DIRECT_CALL_TORCH", ("0.0.",))
        core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path / "b"))
    compiled = core.runner.compiled
    assert all(graph.direct is None and graph.traced for graph in compiled.graphs)
    assert "no direct call on torch" in caplog.text
    assert tokens(run(core, requests)) == eager and compiled.num_fallbacks == 0

    def failing(*args):
        raise RuntimeError("a kernel failed")

    compiled.serial._fn = failing  # the serial graph takes the small steps of these requests
    assert tokens(run(core, requests)) == eager
    assert compiled.serial.failed and compiled.num_fallbacks > 0
    assert "the compiled call failed (RuntimeError: a kernel failed)" in caplog.text


@pytest.mark.timeout(120)
def test_engine_serves_eagerly_when_the_decode_step_cannot_compile(model, caplog, tmp_path):
    """No C++ compiler (a slim image, say): a warning, and the eager path, not a rank that fails to start."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # no graph left from another test in this process
    # config.patch, not monkeypatch: monkeypatch's undo deletes a config module's entry instead of restoring it
    no_compiler = {"cpp.cxx": (None, "/nonexistent/c++")}
    with inductor_config.patch(no_compiler), torch.compiler.config.patch(force_disable_caches=True):
        core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path))
    assert core.runner.compiled is None
    assert "compiling the decode step failed" in caplog.text
    request = ("a", prompt(1), greedy())
    assert tokens(run(core, [request])) == {"a": solo(model, *request)}


def test_layer_stacks_hold_each_layer_tensor_once():
    """The compiled step reads the per-layer weights from one stack per name; the modules' own tensors become
    views of those stacks (same values, same memory), so the eager path and the graph share one copy."""
    from dpserve_engine.compiled import LayerStacks

    model = build_model(ARGS, None, Precision.fp32(), torch.device("cpu"))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    layers = LayerStacks(model)
    per_layer = {name for name in before if name.startswith("layers.")}
    assert {name.removeprefix("model.") for name in layers.where} == per_layer
    assert len(layers.stacks) == len(per_layer) // ARGS.n_layers
    after = model.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)
    for name, (s, i) in layers.where.items():
        tensor = after[name.removeprefix("model.")]
        assert tensor.data_ptr() == layers.stacks[s][i].data_ptr()


def test_saved_step_key_tells_the_grouped_kernel_paths_apart(engine_cache_dir):
    """q4 and q4q8 layers hold the same tensors: the saved decode step's key must still differ, or a step traced
    on one path (its probe included) would be loaded for the other."""
    from dpserve_engine.compiled import CompiledDecode

    def key(path: str) -> str:
        return CompiledDecode(grouped_model(path), [], engine_cache_dir)._saved_step().dir.name  # nothing traced

    assert key("q4") == key("q4") != key("q4q8")


def grouped_model(path: str):
    """The tiny model with each layer's o and down projections as random Q4_1 groups and the LM head as random
    Q8_0 groups, on kernel path `path` ("q4" or "q4q8")."""
    from dpserve_engine.quantized import GroupedHead, GroupedLinear

    model = build_model(ARGS, None, Precision.fp32(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for layer in model.layers:
        for owner, name, k in ((layer.attention, "wo", ARGS.dim), (layer.feed_forward, "w2", ARGS.ffn_dim)):
            q = torch.randint(0, 16, (ARGS.dim, k), generator=gen, dtype=torch.uint8)
            d = torch.rand(ARGS.dim, k // 32, generator=gen) * 0.05
            setattr(owner, name, GroupedLinear(q, d, -8 * d, model.row_split, path))
    q8 = torch.randint(-127, 128, (VOCAB, ARGS.dim), generator=gen, dtype=torch.int8)
    model.fast_head = GroupedHead(q8, torch.rand(VOCAB, ARGS.dim // 32, generator=gen) * 0.01, path)
    return model


@pytest.mark.timeout(180)
def test_compiled_decode_step_runs_the_int8_activation_kernels(tmp_path):
    """Path q4q8's ops (q4q8_linear, q8q8_linear) inside the compiled decode graph (their fake impls in
    kernels.py): the eager tokens, through both graphs, without fallbacks."""
    model = grouped_model("q4q8")
    requests = [(f"r{i}", prompt(i, 3 + 5 * i), greedy(max_tokens=20 + 3 * i)) for i in range(6)]
    compiled_core = engine(model, enforce_eager=False, cache_dir=fresh_cache_dir(tmp_path))
    compiled = compiled_core.runner.compiled
    compiled.serial_max_rows = 3
    assert tokens(run(compiled_core, requests)) == tokens(run(engine(model), requests))
    assert compiled.num_calls > 0 and compiled.num_fallbacks == 0
    assert all(graph.direct is not None and graph.direct.num_calls > 0 for graph in compiled.graphs)


def test_the_kv_cache_is_zero_page_aligned_and_its_buffers_do_not_overlap():
    import mmap

    from dpserve_engine.model_runner import zeroed_buffers

    buffers = zeroed_buffers(4, (2, 37, 8), torch.bfloat16, torch.device("cpu"))  # 1184 bytes each: a page apart
    assert [tuple(b.shape) for b in buffers] == [(2, 37, 8)] * 4
    assert all(b.dtype == torch.bfloat16 and b.is_contiguous() and b.data_ptr() % mmap.PAGESIZE == 0 for b in buffers)
    assert all(not b.any() for b in buffers)
    buffers[1].fill_(1.5)
    assert not buffers[0].any() and not buffers[2].any() and bool((buffers[1] == 1.5).all())
    kept = buffers[3]
    del buffers  # a view keeps the mapping
    kept.add_(2)
    assert bool((kept == 2).all())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populating_the_kv_cache_faults_its_pages_in_and_keeps_what_was_written():
    import threading

    from dpserve_engine.model_runner import populate_in_background, zeroed_buffers

    buffers = zeroed_buffers(4, (2, 256, 1024), torch.float32, torch.device("cpu"))  # 2 MiB each
    buffers[1][0, 3].fill_(7.0)  # a step wrote this before the thread got there
    address = buffers[0].data_ptr()
    assert resident_kib(address, 8 << 20) < 8 << 10
    gate = threading.Event()
    compiling = threading.Thread(target=gate.wait)
    compiling.start()
    thread = populate_in_background(buffers, after=compiling)
    assert thread is not None
    thread.join(timeout=0.2)
    assert thread.is_alive()  # waits for the decode step's preparation
    gate.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    if populate_supported():
        assert resident_kib(address, 8 << 20) == 8 << 10  # every page is in
    assert bool((buffers[1][0, 3] == 7.0).all()) and int(torch.count_nonzero(torch.stack(buffers))) == 1024


def test_a_served_rank_populates_its_kv_cache_and_an_in_process_core_does_not(model):
    assert engine(model).runner.populate_thread is None
    core = engine(model, populate_kv_cache=True)
    assert core.runner.populate_thread is not None
    core.runner.populate_thread.join(timeout=30)
    first = core.runner.kv_caches[0][0]
    if populate_supported():
        size = first.numel() * first.element_size()
        assert resident_kib(first.data_ptr(), size) << 10 >= size  # every page of it
    assert tokens(run(core, [("p", prompt(1), greedy())]))["p"] == solo(model, "p", prompt(1), greedy())


def populate_supported() -> bool:
    """MADV_POPULATE_WRITE: Linux 5.14 and later (elsewhere the thread leaves the pages as they are)."""
    return tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) >= (5, 14)


def resident_kib(address: int, size: int) -> int:
    """KiB of [address, address + size) in memory (mincore; the range's pages, whatever mapping holds them)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(address + size - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * mmap.PAGESIZE >> 10
