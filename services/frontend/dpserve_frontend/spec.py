"""What one generation runs, built from a checked OpenAI request: prompts as token ids, the engine's
`SamplingParams`, stop strings, the pinned rank. One builder serves both endpoints; where they differ (which
field limits the output, its default, how logprobs are asked for) the request types say (`protocol.py`)."""

from __future__ import annotations

import dataclasses

from dpserve_shared.schema import SamplingParams

from dpserve_frontend.protocol import SamplingFields, check_output_fits, stop_strings


@dataclasses.dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None  # the prompt as text (for echo); None when it was given as token ids


@dataclasses.dataclass
class GenerationSpec:
    prompts: list[PromptInput]
    sampling: SamplingParams
    n: int = 1
    stop: list[str] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    pinned_rank: int | None = None
    session_id: str | None = None  # X-Session-Id: keep the conversation on one rank (router.py)


def build_spec(req: SamplingFields, prompts: list[PromptInput], max_model_len: int, pinned_rank: int | None,
               grammar: str | None = None) -> GenerationSpec:
    """The spec of a request whose values `protocol.check_*_request` accepted, constrained to `grammar` (checked
    by structured.GrammarChecker); raises BadRequest when the output does not fit next to the longest prompt."""
    max_tokens = check_output_fits(req, max(len(p.token_ids) for p in prompts), max_model_len)
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=req.engine_logprobs(),
        prompt_logprobs=req.engine_prompt_logprobs(),
        grammar=grammar,
    )
    return GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        n=req.n or 1,
        stop=stop_strings(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        pinned_rank=pinned_rank,
    )
