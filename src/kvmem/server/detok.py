"""Generated token ids -> text, incrementally: each token is decoded once (tokenizers' ``DecodeStream``, the
Rust detokenizer that keeps a few tokens of context for multi-byte characters and leading spaces), so a
streamed answer costs O(tokens), not a decode of everything so far per chunk."""

from __future__ import annotations

from bisect import bisect_left

from tokenizers.decoders import DecodeStream


class IncrementalText:
    """``push(ids)`` -> the text those tokens add (possibly ""; a character split across tokens comes whole,
    once its last byte has come); ``text``: everything so far; ``tokens_for(chars)``: the fewest leading tokens
    whose text holds ``chars`` characters. ``tokenizer``: a transformers tokenizer. A tokenizer without a Rust
    backend falls back to decoding all ids each push (O(tokens) each)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self.ids: list[int] = []
        self.text = ""
        self._ends: list[int] = []  # len(text) once each token was pushed

    def push(self, ids: list[int]) -> str:
        start = len(self.text)
        for t in ids:
            self.ids.append(t)
            if self._stream is not None:
                piece = self._stream.step(self._backend, t)
                if piece:
                    self.text += piece
            else:
                full = self._tok.decode(self.ids, skip_special_tokens=True)
                if not full.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
                    self.text = full
            self._ends.append(len(self.text))
        return self.text[start:]

    def finish(self) -> str:
        """The text still held at the end (bytes of a character that never completed, as a full decode gives
        them: U+FFFD); afterwards ``text`` equals a decode of all the ids."""
        full = self._tok.decode(self.ids, skip_special_tokens=True)
        if len(full) > len(self.text) and full.startswith(self.text):
            rest, self.text = full[len(self.text) :], full
            if self._ends:
                self._ends[-1] = len(full)
            return rest
        return ""

    def tokens_for(self, chars: int) -> int:
        if chars <= 0:
            return 0
        return min(bisect_left(self._ends, chars) + 1, len(self.ids))
