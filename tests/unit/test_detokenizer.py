"""The frontend's incremental detokenizer: complete UTF-8 only, equal to a full decode, stop strings."""

import pytest


from dpserve_frontend.detokenizer import IncrementalDetokenizer
from dpserve_frontend.tokenizer import ModelTokenizer

pytestmark = pytest.mark.timeout(60)

TEXTS = [
    "Hello world",
    "Unicode: café naïve 日本語 한국어 Ελληνικά 🤖🚀 emoji",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, 中文字符测试",
    "tabs\tand\nnewlines  and   spaces",
]


@pytest.fixture(scope="module")
def tok(model_info):
    return ModelTokenizer(model_info)


def stream_pieces(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok.tokenizer, [tok.info.bos_token_id], **kwargs)
    pieces = []
    for token_id in ids:
        detok.add_token(token_id)
        pieces.append(detok.take_new_text(is_finished=False))
    detok.finish()
    pieces.append(detok.take_new_text(is_finished=True))
    return detok, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(tok, text):
    ids = tok.encode(text)
    assert len(ids) >= 2
    detok, pieces = stream_pieces(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert detok.text == text
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a lone surrogate would fail here


def test_emoji_split_over_several_tokens_released_only_when_complete(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # the byte-level vocabulary splits it
    detok = IncrementalDetokenizer(tok.tokenizer)
    for token_id in ids[:-1]:
        assert detok.add_token(token_id) == ""
    assert detok.add_token(ids[-1]) == "🤖"


def test_unfinished_bytes_released_on_finish_as_replacement_char(tok):
    ids = tok.encode("ab🤖")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok.tokenizer)
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.take_new_text(False) == "ab"
    detok.finish()
    assert detok.take_new_text(True) == tok.decode(ids)[2:]


def test_stop_string_excluded_and_stream_holds_back_partial_match(tok):
    text = "one two STOP three"
    detok, pieces = stream_pieces(tok, tok.encode(text), stop=["STOP"])
    assert detok.stop_reason == "STOP"
    assert "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_stop_string_included(tok):
    detok, pieces = stream_pieces(tok, tok.encode("one two STOP three"), stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(pieces) == "one two STOP"


def test_stop_string_spanning_tokens_and_earliest_wins(tok):
    detok, pieces = stream_pieces(tok, tok.encode("abc 日本語 xyz"), stop=["xyz", "本語"])
    assert detok.stop_reason == "本語"
    assert "".join(pieces) == "abc 日"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    _, pieces = stream_pieces(tok, ids)
    assert "".join(pieces) == "hi"
    _, pieces = stream_pieces(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) == "<|im_start|>hi<|im_end|>"


def test_stop_strings_ignored_before_min_tokens(tok):
    ids = tok.encode("a STOP b STOP c")
    detok, pieces = stream_pieces(tok, ids, stop=["STOP"], min_tokens=4)
    assert "".join(pieces) == "a STOP b "
