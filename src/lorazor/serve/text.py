"""Text out of generated tokens: incremental decoding, and stop sequences left out of the returned
text, as OpenAI does."""

from __future__ import annotations

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def visible_text(text: str, stops: list[str], finished: bool) -> str:
    """The part of `text` that can be sent: cut before a stop sequence, and while unfinished, held
    back where a stop sequence may be starting."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        return text[:cut]
    if finished or not stops:
        return text
    hold = max(len(s) for s in stops) - 1
    return text[:max(len(text) - hold, 0)]




class IncrementalText:
    """The text of a growing list of generated tokens, decoded a few tokens at a time.

    Decoding the whole output at every step costs O(length) per request and step; this decodes
    only the tokens since the last complete character (as vLLM's incremental detokenizer does):
    the text of tokens [prefix, read) is known, and the text of [prefix, end) minus it is new,
    unless it ends in an incomplete character (U+FFFD), which waits for the next token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0
        self._read = 0

    def update(self, token_ids, finished: bool = False) -> str:
        """The full text so far (`token_ids`: a list or an output's `TokenPrefix`; only its new tail
        is read). When `finished`, the whole output is decoded once, so the final text is exactly
        the tokenizer's decode of all of it."""
        if finished:
            self.text = self._decode(token_ids[:])
            return self.text
        known = self._decode(token_ids[self._prefix:self._read])
        new = self._decode(token_ids[self._prefix:])
        if len(new) > len(known) and not new.endswith("\ufffd"):
            self.text += new[len(known):]
            self._prefix, self._read = self._read, len(token_ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
