"""Incremental detokenization and stop strings for one sequence.

Tokens arrive a few at a time. A byte-level BPE token can hold part of a multi-byte UTF-8 character (an emoji
is often three or four tokens), so text is only released once it is complete: `tokenizers`' `DecodeStream`
buffers the bytes of an unfinished character, primed with the prompt so that tokenizers which treat the first
token specially (SentencePiece's leading space) decode exactly as the full sequence would.

Stop strings are matched on the text: when one appears, the text is cut before it (or after it with
`include_stop_str_in_output`) and the sequence is finished; the caller then aborts it on the engine. While
streaming, the last `max(len(stop)) - 1` characters are held back, because they may be the start of a stop
string that the next token completes; they are released when the sequence finishes.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6  # prompt tokens the stream is primed with (enough context for any decoder's prefix rule)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        prime = list(prompt_token_ids[-_PRIME_TOKENS:]) if prompt_token_ids else []
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens) if prime else DecodeStream(
            skip_special_tokens=skip_special_tokens
        )
        self._token_ids: list[int] = []
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens  # stop strings are not checked before this many tokens (vLLM's rule)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all decoded output text (after a stop string is cut)
        self._num_emitted = 0  # characters of `text` already handed out by `take_new_text`
        self.stop_reason: str | None = None  # the stop string that ended the sequence

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def add_token(self, token_id: int) -> str:
        """Add one token; return the text it completed (empty while a character is unfinished)."""
        if self.is_stopped:
            return ""
        self._token_ids.append(token_id)
        piece = self._stream.step(self._tokenizer, token_id) or ""
        if piece:
            start = len(self.text)
            self.text += piece
            if len(self._token_ids) >= self._min_tokens:
                self._check_stop(start, len(piece))
        return piece

    def add_tokens(self, token_ids: list[int]) -> int:
        """Add tokens in order, as `add_token` each, up to a stop string; return how many were taken."""
        if self.stop_reason is not None:
            return 0
        if self._stop:
            for i, token_id in enumerate(token_ids):
                self.add_token(token_id)
                if self.stop_reason is not None:
                    return i + 1
            return len(token_ids)
        # No stop strings: nothing to check per piece, so only the stream and the text move.
        step, tokenizer = self._stream.step, self._tokenizer
        self._token_ids.extend(token_ids)
        for token_id in token_ids:
            piece = step(tokenizer, token_id)
            if piece:
                self.text += piece
        return len(token_ids)

    def finish(self) -> str:
        """The sequence ended: release undecodable trailing bytes (as U+FFFD, like a full decode does)."""
        if self.is_stopped or not self._token_ids:
            return ""
        full = self._tokenizer.decode(self._token_ids, skip_special_tokens=self._skip_special_tokens)
        if full.startswith(self.text) and len(full) > len(self.text):
            tail = full[len(self.text):]
            start = len(self.text)
            self.text = full
            self._check_stop(start, len(tail))
            return tail
        return ""

    def _check_stop(self, start: int, num_new: int) -> None:
        if not self._stop:
            return
        # A stop string may begin up to len(stop) - 1 characters before the new text.
        search_from = max(0, start - self._hold)
        best = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_reason = stop

    def take_new_text(self, is_finished: bool) -> str:
        """Text not yet handed out; while running, holds back what could still become a stop string."""
        end = len(self.text)
        if not (is_finished or self.is_stopped) and self._hold:
            end = max(self._num_emitted, end - self._hold)
        new = self.text[self._num_emitted:end]
        self._num_emitted = end
        return new
