"""Fixtures the structured-output and tool-call unit tests share."""

import llguidance
import pytest


@pytest.fixture(scope="module")
def lltok(model_info):
    """The bundled model's tokenizer as llguidance takes it."""
    return llguidance.LLTokenizer(model_info.tokenizer_json, n_vocab=model_info.vocab_size,
                                  eos_token=model_info.eos_token_ids)


@pytest.fixture
def accepts(lltok):
    """accepts(grammar, text): the grammar allows `text` as a whole output."""

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(lltok.tokenize_str(text)) and matcher.is_accepting()

    return accepts
