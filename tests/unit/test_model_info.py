"""ModelInfo: the tokenizer built from the bundled GGUF's metadata: unicode round trips, specials, chat template."""

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer

from dpserve_engine.model_files import ModelFilesNotFound, resolve_model_path
from dpserve_engine.model_info import load_model_info
from dpserve_engine.settings import EngineConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def info():
    return load_model_info(EngineConfig())


@pytest.fixture(scope="module")
def tokenizer(info):
    return Tokenizer.from_str(info.tokenizer_json)


@pytest.mark.parametrize(
    "text",
    [
        "Unicode: café naïve 日本語 한국어 Ελληνικά 🤖🚀 emoji",
        "tabs\tand\nnewlines  and   spaces",
        "def f(x):\n    return x ** 2  # code",
        "<|im_start|>user\nhi<|im_end|>",
        "12345 digits",
    ],
)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_special_tokens_and_digits(info, tokenizer):
    assert tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False).ids == [1, 2]
    assert len(tokenizer.encode("12345", add_special_tokens=False).ids) == 5
    assert info.eos_token_ids == [2, 0] and info.vocab_size == 49152 and not info.add_bos_token


def test_chat_template_renders_the_known_prompt(info, tokenizer):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(info.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == 37 and ids[:3] == [1, 9690, 198] and ids[-3:] == [520, 9531, 198]


def test_missing_model_names_the_path(tmp_path):
    with pytest.raises(ModelFilesNotFound, match="config.json"):
        (tmp_path / "tokenizer.json").write_text("{}")
        resolve_model_path(str(tmp_path))
