"""Formatting of logprobs (pure): completions' tokens/token_logprobs/top_logprobs/text_offset, chat's content."""

import pytest

from dpserve_frontend.logprobs import chat_logprobs, completion_logprobs
from dpserve_frontend.tokenizer import ModelTokenizer
from dpserve_shared.schema import TokenLogprob

pytestmark = pytest.mark.timeout(30)


def test_completion_logprobs(model_info):
    tok = ModelTokenizer(model_info)
    ids = [1000, 1001, 1002]
    entries = [TokenLogprob(1000, -0.5, 1, [1000, 7], [-0.5, -1.0]),
               TokenLogprob(1001, float("-inf"), 3, [5, 6], [-0.1, -0.2]),
               None]
    out = completion_logprobs(tok, ids, entries, 1, initial_offset=10)
    assert out["tokens"] == ["()", " loc", '",']
    assert out["text_offset"] == [10, 12, 16]
    assert out["token_logprobs"] == [-0.5, -9999.0, None]
    assert out["top_logprobs"][0] == {"()": -0.5}
    assert out["top_logprobs"][1] == {" loc": -9999.0, tok.token_text(5): -0.1}
    assert out["top_logprobs"][2] is None


def test_chat_logprobs(model_info):
    tok = ModelTokenizer(model_info)
    content = chat_logprobs(tok, [1000], [TokenLogprob(1000, -0.25, 1, [1000, 9], [-0.25, -2.0])], 2)["content"]
    assert content == [{
        "token": "()", "logprob": -0.25, "bytes": [40, 41],
        "top_logprobs": [{"token": "()", "logprob": -0.25, "bytes": [40, 41]},
                         {"token": tok.token_text(9), "logprob": -2.0, "bytes": list(tok.token_text(9).encode())}],
    }]
