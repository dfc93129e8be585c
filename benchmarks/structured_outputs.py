"""Structured outputs and tool calls (issue 37), measured: what the constraints promise, and what they cost.

    .venv/bin/python benchmarks/structured_outputs.py http --url http://127.0.0.1:8000   # against `make serve`
    .venv/bin/python benchmarks/structured_outputs.py engine                              # in-process EngineCore

`http`, through the official `openai` client against a running deployment (make serve's: DP=2, 2 API servers):
  - json_schema requests over a seeded set of distinct schemas (pydantic-generated strict schemas with
    `$defs`/`anyOf`, enums, bounded strings and arrays, nested objects, and hand-written ones), temperatures 0 and
    1, max_tokens 512: the share that finish with `stop` and validate (jsonschema, Draft 2020-12), and the share
    that end with `length`;
  - json_object, regex, choice and grammar constraints; `chat.completions.parse(response_format=Model)`;
    tool_choice required and named, streamed and not (the streamed arguments must equal the whole response's for the
    same seed); a multi-turn exchange with tool results;
  - a streamed unconstrained request's inter-token latency (p50/p99) while other clients send one-token requests
    at a fixed rate, first unconstrained, then each with a large schema of its own (compiled by an API server and
    an engine): the difference is what the compiles cost the stream.
`engine`, one EngineCore on the bundled model, in this process:
  - each schema's grammar compiled into an llguidance matcher (as an engine compiles it; no cache), p50/p99;
  - decode steps at batch 32, every row constrained vs none, interleaved rounds (A B A B ...): median and p99 step
    times, and an unconstrained round before any grammar was ever seen (a batch without constrained rows builds no
    mask).
Prints one JSON line per part at the end (`--output-json` writes them too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from typing import Any, Literal, Optional

WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "grove", "harbor", "indigo", "juniper", "kepler",
         "lumen", "maple", "nimbus", "onyx", "prairie", "quartz", "raven", "sierra", "tundra", "umber", "vega",
         "willow", "xenon", "yarrow", "zephyr")  # fmt: skip
CITIES = ("Paris", "Rome", "Oslo", "Lima", "Kyiv", "Doha", "Quito", "Accra", "Hanoi", "Perth")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# -- the schema set -------------------------------------------------------------------------------------------

def _pydantic_schema(rng: random.Random, i: int) -> tuple[str, dict[str, Any], type]:
    """A pydantic model drawn from `rng` and its strict schema (what `parse()` sends): nested models (`$defs`),
    optional fields (`anyOf` with null), enums, bounded strings, integers and arrays."""
    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field, create_model

    names = rng.sample(WORDS, 8)
    cities = tuple(rng.sample(CITIES, rng.randint(2, 5)))
    place = create_model(f"Place{i}", __base__=BaseModel,
                         city=(Literal[cities], ...),  # type: ignore[valid-type]
                         code=(str, Field(pattern=r"^[A-Z]{3}$")))  # fmt: skip
    fields: dict[str, Any] = {
        names[0]: (str, Field(max_length=rng.randint(8, 40))),
        names[1]: (int, Field(ge=0, le=rng.choice((9, 99, 1000)))),
    }
    shape = i % 5
    if shape in (0, 3):
        fields[names[2]] = (place, ...)  # a nested model: $defs
        fields[names[3]] = (Optional[place], ...)  # anyOf [$ref, null]
    if shape in (1, 3):
        fields[names[4]] = (list[Literal[tuple(rng.sample(WORDS, 4))]], Field(max_length=rng.randint(1, 4)))  # type: ignore[misc]
    if shape in (2, 4):
        fields[names[5]] = (Optional[bool], ...)
        fields[names[6]] = (float, Field(ge=-10, le=10))
    if shape == 4:
        inner = create_model(f"Inner{i}", __base__=BaseModel, label=(str, Field(max_length=12)),
                             places=(list[place], Field(min_length=1, max_length=2)))  # fmt: skip
        fields[names[7]] = (inner, ...)
    model = create_model(f"Record{i}", __base__=BaseModel, **fields)
    return model.__name__, to_strict_json_schema(model), model


def _handwritten_schema(rng: random.Random, i: int) -> tuple[str, dict[str, Any], None]:
    """A schema written by hand: enums, const, bounded arrays of objects, integer ranges, oneOf-free unions."""
    a, b, c = rng.sample(WORDS, 3)
    schema = {
        "type": "object",
        "properties": {
            a: {"enum": rng.sample(CITIES, 3)},
            b: {"type": "array", "minItems": 1, "maxItems": rng.randint(1, 3), "items": {
                "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 50},
                                                 "ok": {"type": "boolean"}},
                "required": ["n", "ok"], "additionalProperties": False}},
            c: {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer", "minimum": 0, "maximum": 9}]},
            "version": {"const": i},
        },
        "required": [a, b, c, "version"],
        "additionalProperties": False,
    }  # fmt: skip
    return f"Hand{i}", schema, None


def schema_set(n: int, seed: int = 37) -> list[tuple[str, dict[str, Any], type | None]]:
    """`n` distinct schemas (name, schema, pydantic model or None), the same for a seed."""
    rng = random.Random(seed)
    out = [(_pydantic_schema if i % 4 else _handwritten_schema)(rng, i) for i in range(n)]
    assert len({json.dumps(s, sort_keys=True) for _, s, _ in out}) == n
    return out


def large_schema(rng: random.Random, num_properties: int = 60) -> dict[str, Any]:
    """A large schema nobody sent before (so no cache has it): many properties, enums and nested objects."""
    props = {}
    for k in range(num_properties):
        name = f"{rng.choice(WORDS)}_{k}_{rng.randrange(10**6)}"
        props[name] = rng.choice((
            {"type": "string", "maxLength": rng.randint(4, 30)},
            {"enum": rng.sample(WORDS, 5)},
            {"type": "integer", "minimum": 0, "maximum": rng.randint(10, 10**4)},
            {"type": "object", "properties": {w: {"type": "boolean"} for w in rng.sample(WORDS, 4)},
             "required": [], "additionalProperties": False},
        ))  # fmt: skip
    return {"type": "object", "properties": props, "required": list(props)[:10], "additionalProperties": False}


# -- http -----------------------------------------------------------------------------------------------------

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": list(CITIES)},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER_PARAMS, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "strict": True,
                                      "parameters": {"type": "object", "properties": {"city": {"enum": list(CITIES)}},
                                                     "required": ["city"], "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
LARK = 'start: NUM OP NUM " = " NUM "."\nOP: " + " | " * "\nNUM: /[0-9]{1,3}/'
LARK_CHECK = re.compile(r"[0-9]{1,3}( \+ | \* )[0-9]{1,3} = [0-9]{1,3}\.")


async def http_part(args) -> dict[str, Any]:
    import jsonschema
    import openai

    client = openai.AsyncOpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                                max_retries=0, timeout=600)  # fmt: skip
    model = (await client.models.list()).data[0].id
    if args.only_itl:
        report = await itl_under_compiles(args, model)
        await client.close()
        return report
    sem = asyncio.Semaphore(args.concurrency)
    schemas = schema_set(args.schemas)
    failures: list[str] = []

    async def limited(coro):
        async with sem:
            return await coro

    # json_schema over the set
    async def one_schema(k: int) -> tuple[str, bool]:
        name, schema, _ = schemas[k % len(schemas)]
        temperature = 0.0 if k % 2 == 0 else 1.0
        messages = [{"role": "user", "content": f"Write a JSON record ({name}) with plausible values."}]
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=512, temperature=temperature, seed=k,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        choice = r.choices[0]
        if choice.finish_reason != "stop":
            return choice.finish_reason, False
        try:
            jsonschema.Draft202012Validator(schema).validate(json.loads(choice.message.content))
            return "stop", True
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"schema {name} seed {k}: {e!s:.200} in {choice.message.content[:200]!r}")
            return "stop", False

    started = time.perf_counter()
    print(f"json_schema: {args.requests} requests over {len(schemas)} schemas, c={args.concurrency} ...",
          file=sys.stderr, flush=True)
    results = await asyncio.gather(*(limited(one_schema(k)) for k in range(args.requests)))
    schema_s = time.perf_counter() - started
    stopped = [ok for finish, ok in results if finish == "stop"]
    report: dict[str, Any] = {
        "json_schema_requests": len(results), "schemas": len(schemas),
        "stop_valid": sum(stopped), "stop_invalid": len(stopped) - sum(stopped),
        "length": sum(1 for finish, _ in results if finish == "length"),
        "other_finish": sum(1 for finish, _ in results if finish not in ("stop", "length")),
        "json_schema_seconds": round(schema_s, 1),
    }
    print(f"  {report}", file=sys.stderr, flush=True)

    # the other constraints, 10 each, temperatures 0 and 1
    async def other(kind: str, k: int) -> bool:
        temperature = float(k % 2)
        if kind == "json_object":
            r = await client.chat.completions.create(model=model, messages=ASK, max_tokens=512, seed=k,
                                                     temperature=temperature, response_format={"type": "json_object"})
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            return finish == "length" or isinstance(json.loads(text), dict)
        body = {"regex": {"structured_outputs": {"regex": r"[A-Z][a-z]{1,9}, [0-9]{4}-[01][0-9]-[0-3][0-9]"}},
                "choice": {"structured_outputs": {"choice": ["red", "green", "blue"]}},
                "grammar": {"structured_outputs": {"grammar": LARK}}}[kind]
        r = await client.completions.create(model=model, prompt=f"Example {k}:", max_tokens=64, seed=k,
                                            temperature=temperature, extra_body=body)  # fmt: skip
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        if finish != "stop":
            failures.append(f"{kind} seed {k}: finish {finish} {text!r}")
            return False
        ok = {"regex": lambda t: re.fullmatch(r"[A-Z][a-z]{1,9}, [0-9]{4}-[01][0-9]-[0-3][0-9]", t),
              "choice": lambda t: t in ("red", "green", "blue"),
              "grammar": lambda t: LARK_CHECK.fullmatch(t)}[kind](text)  # fmt: skip
        if not ok:
            failures.append(f"{kind} seed {k}: {text!r}")
        return bool(ok)

    for kind in ("json_object", "regex", "choice", "grammar"):
        oks = await asyncio.gather(*(limited(other(kind, k)) for k in range(10)))
        report[f"{kind}_ok"] = f"{sum(oks)}/{len(oks)}"

    # parse() with pydantic models
    models = [m for _, _, m in schemas if m is not None][:10]
    parsed_ok = 0
    for k, m in enumerate(models):
        r = await client.chat.completions.parse(model=model, messages=ASK, response_format=m, max_tokens=512, seed=k)
        parsed_ok += isinstance(r.choices[0].message.parsed, m)
    report["parse_ok"] = f"{parsed_ok}/{len(models)}"

    # tools: required and named, streamed and not, the same seed
    tool_ok = tool_total = 0
    for k in range(10):
        for choice in ("required", {"type": "function", "function": {"name": TOOLS[k % 2]["function"]["name"]}}):
            kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=256, seed=k,
                          temperature=float(k % 2))
            whole = await client.chat.completions.create(**kwargs)
            calls = whole.choices[0].message.tool_calls or []
            streamed: dict[int, list[str]] = {}
            async for chunk in await client.chat.completions.create(**kwargs, stream=True):
                for c in chunk.choices:
                    for call in c.delta.tool_calls or []:
                        streamed.setdefault(call.index, []).append(call.function.arguments or "")
            tool_total += 1
            try:
                assert calls, "no call"
                for n, call in enumerate(calls):
                    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
                    jsonschema.validate(json.loads(call.function.arguments), params)
                    assert "".join(streamed.get(n, [])) == call.function.arguments, "streamed arguments differ"
                assert whole.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
                tool_ok += 1
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                failures.append(f"tools {choice} seed {k}: {e!s:.200}")
    report["tool_calls_ok"] = f"{tool_ok}/{tool_total}"
    first = (await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=256, seed=1)).choices[0].message.tool_calls[0]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
                   {"role": "tool", "tool_call_id": first.id, "content": '{"forecast": "sunny, 24 C"}'}]
    answer = await client.chat.completions.create(model=model, messages=turns, tools=TOOLS, max_tokens=64)
    report["multi_turn_finish"] = answer.choices[0].finish_reason
    report.update(await itl_under_compiles(args, model))
    report["failures"] = failures[:20]
    await client.close()
    return report


async def itl_under_compiles(args, model: str) -> dict[str, Any]:
    """A streamed unconstrained request's gaps between content chunks, while `--compile-clients` clients send
    one-token requests: unconstrained (the baseline), then each with a large new schema."""
    import aiohttp

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(11)

    async def stream(session) -> list[float]:
        body = {"model": model, "prompt": "A long story about the sea: ", "max_tokens": args.stream_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        gaps, last = [], None
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        return gaps[1:]  # from the second gap: the first token's prefill is not a gap

    async def background(session, stop: asyncio.Event, constrained: bool, counter: list[int]) -> None:
        """One client's requests at a fixed rate (the same with and without schemas: a slower answer must not mean
        less load on the stream's rank)."""
        interval_s = args.compile_clients / args.background_rate
        while not stop.is_set():
            started = time.perf_counter()
            body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "A record."}],
                                    "max_tokens": 1, "temperature": 0}
            if constrained:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "big",
                                                                                  "schema": large_schema(rng)}}
            async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
                await response.read()
                counter[0] += response.status == 200
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - started)))

    async def measure(constrained: bool) -> tuple[list[float], int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            stop, counter = asyncio.Event(), [0]
            tasks = [asyncio.ensure_future(background(session, stop, constrained, counter))
                     for _ in range(args.compile_clients)]
            await asyncio.sleep(1.0)
            gaps = await stream(session)
            stop.set()
            await asyncio.gather(*tasks)
            return gaps, counter[0]

    out: dict[str, Any] = {"large_schema_bytes": len(json.dumps(large_schema(random.Random(1))))}
    for round_ in range(args.itl_rounds):
        for constrained in (False, True):
            gaps, sent = await measure(constrained)
            key = "itl_compiling" if constrained else "itl_baseline"
            out.setdefault(key + "_ms", []).extend(g * 1e3 for g in gaps)
            out[key + "_requests"] = out.get(key + "_requests", 0) + sent
            print(f"  itl round {round_} {'compiling' if constrained else 'baseline'}: p50 "
                  f"{statistics.median(gaps) * 1e3:.1f} ms p99 {percentile(gaps, 99) * 1e3:.1f} ms, {sent} "
                  "background requests", file=sys.stderr, flush=True)
    for key in ("itl_baseline", "itl_compiling"):
        gaps = out.pop(key + "_ms")
        out[key + "_p50_ms"] = round(statistics.median(gaps), 2)
        out[key + "_p99_ms"] = round(percentile(gaps, 99), 2)
    out["itl_p99_ratio"] = round(out["itl_compiling_p99_ms"] / out["itl_baseline_p99_ms"], 3)
    return out


# -- engine ---------------------------------------------------------------------------------------------------

def engine_part(args) -> dict[str, Any]:
    import llguidance
    import torch
    from dpserve_shared.schema import EngineRequest, SamplingParams

    from dpserve_engine import cpu_paths
    from dpserve_engine.core import EngineCore
    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig
    from dpserve_frontend.structured import JsonOptions, json_schema_grammar

    machine = cpu_paths.detect().describe()
    print(f"cpu={machine['cpu_model']!r} torch_capability={machine['torch_capability']} "
          f"flags={','.join(machine['flags'])}", file=sys.stderr, flush=True)
    config = EngineConfig(max_num_seqs=args.batch, enable_prefix_caching=False)
    info = load_model_info(config)
    tokenizer = llguidance.LLTokenizer(info.tokenizer_json, n_vocab=info.vocab_size,
                                       eos_token=info.eos_token_ids or None)  # fmt: skip
    grammars = [json_schema_grammar(schema, "bench", JsonOptions()).grammar for _, schema, _ in schema_set(args.schemas)]
    compile_ms = []
    for grammar in grammars * 2:  # twice: the second pass is as cold (no cache here), a check on noise
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        bitmask = torch.zeros((1, (info.vocab_size + 31) // 32), dtype=torch.int32).numpy()
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, 0)  # the first mask: part of what a request waits for
        compile_ms.append((time.perf_counter() - started) * 1e3)
        assert not matcher.is_error(), matcher.get_error()
    large_ms = []
    rng = random.Random(5)
    for _ in range(20):
        grammar = json_schema_grammar(large_schema(rng), "bench", JsonOptions()).grammar
        started = time.perf_counter()
        llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        large_ms.append((time.perf_counter() - started) * 1e3)

    core = EngineCore(config)
    vocab = core.runner.model.args.vocab_size
    # Long outputs: every row stays in decode through the round (a string of at least 1500 characters)
    long_schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                    "body": {"type": "string", "minLength": 1500,
                                                             "maxLength": 3000}},
                   "required": ["title", "body"], "additionalProperties": False}  # fmt: skip
    long_grammar = json_schema_grammar(long_schema, "bench", JsonOptions()).grammar
    counter = [0]

    def round_(constrained: bool) -> list[float]:
        ids = []
        for i in range(args.batch):
            counter[0] += 1
            prompt = [(1000 + 37 * i + 11 * j) % (vocab - 100) + 100 for j in range(args.prompt_len)]
            params = SamplingParams(temperature=1.0, seed=counter[0], max_tokens=args.steps + 16,
                                    ignore_eos=not constrained, grammar=long_grammar if constrained else None)
            request_id = f"bench-{counter[0]}"
            ids.append(request_id)
            core.add_request(EngineRequest(request_id, prompt, params))
        while len(core.scheduler.running) < args.batch or any(s.is_prefilling for s in core.scheduler.running):
            core.step()
        core.step()
        times = []
        for _ in range(args.steps):
            assert len(core.scheduler.running) == args.batch
            started = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - started)
        core.abort(ids)
        core.step()
        return times

    print(f"engine: batch {args.batch}, {args.rounds} rounds of {args.steps} decode steps each way", file=sys.stderr,
          flush=True)
    round_(False)  # warm-up
    before_any = round_(False)
    a, b = [], []
    for i in range(args.rounds):
        a += round_(False)
        b += round_(True)
        print(f"  round {i}: unconstrained {statistics.median(a[-args.steps:]) * 1e3:.1f} ms, constrained "
              f"{statistics.median(b[-args.steps:]) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return {
        "machine": machine["cpu_model"], "torch_capability": machine["torch_capability"],
        "flags": machine["flags"], "threads": torch.get_num_threads(), "batch": args.batch,
        "compile_schemas": len(grammars), "compile_p50_ms": round(statistics.median(compile_ms), 2),
        "compile_p99_ms": round(percentile(compile_ms, 99), 2), "compile_max_ms": round(max(compile_ms), 2),
        "large_schema_compile_p50_ms": round(statistics.median(large_ms), 2),
        "large_schema_compile_p99_ms": round(percentile(large_ms, 99), 2),
        "step_unconstrained_before_any_grammar_ms": round(statistics.median(before_any) * 1e3, 2),
        "step_unconstrained_p50_ms": round(statistics.median(a) * 1e3, 2),
        "step_unconstrained_p99_ms": round(percentile(a, 99) * 1e3, 2),
        "step_constrained_p50_ms": round(statistics.median(b) * 1e3, 2),
        "step_constrained_p99_ms": round(percentile(b, 99) * 1e3, 2),
        "p50_ratio": round(statistics.median(b) / statistics.median(a), 3),
        # each round's constrained median over the unconstrained round just before it, then the median of those:
        # slow drifts in the machine's load cancel
        "paired_ratio": round(statistics.median(
            statistics.median(b[i:i + args.steps]) / statistics.median(a[i:i + args.steps])
            for i in range(0, len(a), args.steps)), 3),
        "p99_ratio": round(percentile(b, 99) / percentile(a, 99), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    h = sub.add_parser("http", help="constraints and tools through a running deployment, and ITL under compiles")
    h.add_argument("--url", default="http://127.0.0.1:8000")
    h.add_argument("--api-key", default=None)
    h.add_argument("--requests", type=int, default=200, help="json_schema requests (default: %(default)s)")
    h.add_argument("--schemas", type=int, default=50, help="distinct schemas (default: %(default)s)")
    h.add_argument("--concurrency", type=int, default=16)
    h.add_argument("--compile-clients", type=int, default=2, help="clients sending large schemas (default: 2)")
    h.add_argument("--background-rate", type=float, default=8.0,
                   help="their requests a second, all together, with schemas or without (default: %(default)s)")
    h.add_argument("--stream-tokens", type=int, default=96)
    h.add_argument("--itl-rounds", type=int, default=3)
    h.add_argument("--only-itl", action="store_true", help="only the inter-token latency under compiles")
    e = sub.add_parser("engine", help="compile times and the masked step's cost, one EngineCore in this process")
    e.add_argument("--schemas", type=int, default=50)
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--prompt-len", type=int, default=32)
    e.add_argument("--rounds", type=int, default=16)
    e.add_argument("--steps", type=int, default=6)
    for sp in (h, e):
        sp.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    report = asyncio.run(http_part(args)) if args.part == "http" else engine_part(args)
    report = {"part": args.part, "date": time.strftime("%Y-%m-%d"), **report}
    print(json.dumps(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
