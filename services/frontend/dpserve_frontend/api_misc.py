"""The small endpoints: /v1/models, /health, /tokenize, /detokenize, /version, /metrics."""

from __future__ import annotations

from importlib import metadata

from aiohttp import web

from dpserve_frontend.errors import BadRequest, NotFound
from dpserve_frontend.metrics import CONTENT_TYPE
from dpserve_frontend.parsing import read_request
from dpserve_frontend.protocol import DetokenizeRequest, TokenizeRequest, check_token_id, message_dicts
from dpserve_frontend.responses import json_response
from dpserve_frontend.state import FrontendState
from dpserve_frontend.tools import template_tools


def _version() -> str:
    try:
        return metadata.version("dpserve-frontend")
    except metadata.PackageNotFoundError:
        return "0.0.0"


async def list_models(request: web.Request, state: FrontendState) -> web.Response:
    data = []
    info = state.model_info
    if info is not None:
        data.append({
            "id": info.name,
            "object": "model",
            "created": int(state.started_at),
            "owned_by": "dpserve",
            "root": info.root,
            "parent": None,
            "max_model_len": info.max_model_len,
            "permission": [],
        })
    return json_response({"object": "list", "data": data})


async def health(request: web.Request, state: FrontendState) -> web.Response:
    """200 while at least one rank serves ("degraded" if some expected rank does not), 503 otherwise (none serves,
    or "draining": this API server is shutting down, so a load balancer stops sending to it); the body
    lists every rank's state ("ready", "starting", "draining", "dead" or "failed": a crash loop), its restarts and
    why it is down. `?rank=N`: that rank alone, 200 when it serves, else 503 (404 for a rank not in the
    deployment)."""
    status, serving, expected = state.health()
    ranks = state.rank_health()
    if "rank" in request.query:
        try:
            rank = int(request.query["rank"])
        except ValueError:
            raise BadRequest(f"rank must be an integer, got {request.query['rank']!r}", param="rank") from None
        entry = next((r for r in ranks if r["rank"] == rank), None)
        if entry is None:
            raise NotFound(f"rank {rank} is not in this deployment (ranks: {[r['rank'] for r in ranks]})",
                           param="rank")  # fmt: skip
        return json_response(entry, 200 if rank in serving and not state.is_draining else 503)
    code = 200 if status in ("ok", "degraded") else 503
    body = {"status": status, "serving_ranks": serving, "data_parallel_size": expected, "ranks": ranks}
    return json_response(body, code)


async def ping(request: web.Request, state: FrontendState) -> web.Response:
    """vLLM's /ping: /health's status code with an empty body."""
    return web.Response(status=200 if state.health()[0] in ("ok", "degraded") else 503)


async def load(request: web.Request, state: FrontendState) -> web.Response:
    """vLLM's /load: the HTTP requests this API server is handling now (one of several behind the port)."""
    return json_response({"server_load": max(0, state.num_http_in_flight - 1)})  # not counting itself


async def tokenize(request: web.Request, state: FrontendState) -> web.Response:
    req = await read_request(request, TokenizeRequest, state.settings.strict_request_fields)
    info, tok = state.require_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        add_special = bool(req.add_special_tokens)
        tools = template_tools(req.tools) if req.tools else None
        _, ids = tok.encode_chat(message_dicts(req.messages), req.add_generation_prompt,
                                 req.continue_final_message, add_special, req.chat_template_kwargs, tools)
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt, add_special_tokens=add_special)
    body = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
    return json_response(body)


async def detokenize(request: web.Request, state: FrontendState) -> web.Response:
    req = await read_request(request, DetokenizeRequest, state.settings.strict_request_fields)
    _, tok = state.require_model(req.model)
    for token_id in req.tokens:
        check_token_id(token_id, tok.vocab_size, "tokens")
    return json_response({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})


async def version(request: web.Request, state: FrontendState) -> web.Response:
    return json_response({"version": _version()})


async def metrics(request: web.Request, state: FrontendState) -> web.Response:
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
