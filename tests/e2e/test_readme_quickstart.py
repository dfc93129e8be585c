"""The README's first request, literally: its `dpserve serve` flags and its curl body, against the real model."""

import json
import os
import re
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_quickstart() -> tuple[list[str], str, dict]:
    """(the serve command's flags, the curl's path, the curl's JSON body) from README.md's "Using it"."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Using it"):]
    serve = re.search(r"\.venv/bin/dpserve serve (.*)", section).group(1).split()
    curl = re.search(r"curl localhost:\d+(/v1/\S+) .*?-d '(.*?)'", section, re.S)
    return serve, curl.group(1), json.loads(curl.group(2))


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_the_readmes_first_request_answers_as_written(serve_factory):
    flags, path, body = readme_quickstart()
    assert flags == ["--data-parallel-size", "2", "--api-server-count", "2", "--port", "8000"]  # what we start
    server = serve_factory(backend="ray", data_parallel_size=2, api_server_count=2, null_engine=False)
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    content = answer["choices"][0]["message"]["content"]
    assert "Paris" in content, content
    assert answer["usage"]["completion_tokens"] <= body["max_tokens"]
    log = server.log()
    for rank in (0, 1):  # Ray's log folding once hid every line of rank 1 (they differ only in numbers)
        assert f"engine[{rank}] INFO registered as rank {rank}" in log, log[-3000:]
