"""What a request aiohttp's HTTP parser refused is answered with (dpserve_frontend.errors.parser_error)."""

import pytest
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, InvalidHeader, LineTooLong

from dpserve_frontend.errors import parser_error

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("exc, status, code", [
    (LineTooLong(b"X-Big...", 8190), 431, "request_header_fields_too_large"),
    (LineTooLong(b"/v1/aaaa...", 8190), 414, "uri_too_long"),
    (LineTooLong(b"http://host/aaaa...", 8190), 414, "uri_too_long"),
    (BadHttpMethod("G\x00T"), 400, "bad_http_request"),
    (InvalidHeader(b"Bad Name"), 400, "bad_http_request"),
    (BadHttpMessage("Invalid method encountered"), 400, "bad_http_request"),
])  # fmt: skip
def test_parser_errors_become_openai_errors_with_the_status_http_gives(exc, status, code):
    error = parser_error(exc, 400, None)
    body = error.to_dict()["error"]
    assert (error.status, body["code"], body["type"]) == (status, code, "invalid_request_error")
    assert body["message"].startswith("The HTTP request could not be parsed: ")


def test_a_handler_failure_is_left_to_aiohttp():
    assert parser_error(RuntimeError("boom"), 500, None) is None
    assert parser_error(None, 504, None) is None
