"""A model without a chat template (a base model) serves completions; chat is a 400 that names --chat-template."""

import msgspec
import pytest

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.tokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(60)


def test_chat_without_a_template_is_a_400_naming_the_flag(model_info):
    tok = ModelTokenizer(msgspec.structs.replace(model_info, chat_template=None))
    assert tok.encode("The capital of France is")  # completions need no template
    with pytest.raises(BadRequest, match=r"has no chat template .*--chat-template FILE") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.status == 400


def test_a_template_given_replaces_the_missing_one(model_info):
    info = msgspec.structs.replace(model_info, chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert ModelTokenizer(info).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
