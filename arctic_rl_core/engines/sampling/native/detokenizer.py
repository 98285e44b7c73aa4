"""A completion's text, extended token by token, for stop strings: each new token costs two short decodes.

Decoding the whole completion at every token would cost O(length) per token:
for 64 completions of 512 tokens, milliseconds of host time per decode step,
more than the step itself on a GPU. As vLLM's incremental detokenizer, this
decodes a short window twice, from the last point where the text was whole:
``tokens[prefix:]`` minus ``tokens[prefix:read]``. Both windows start at the
same token, so a tokenizer that drops the first token's leading space does so
in both; tokens whose text ends in U+FFFD (part of a UTF-8 character) wait for
the token that completes it.
"""

from __future__ import annotations

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The text of ``token_ids[start:]``, as a tokenizer decodes it, kept up to date by ``extend``."""

    def __init__(self, start: int):
        self.text = ""
        self._prefix = start  # the window's first token: its text is in ``text`` already
        self._read = start  # tokens before this are in ``text``

    def extend(self, tokenizer, token_ids: list[int]) -> str:
        """Take in ``token_ids`` (the same list, longer than last time); returns the text they added."""
        if len(token_ids) <= self._read:
            return ""
        before = decode(tokenizer, token_ids[self._prefix : self._read])
        after = decode(tokenizer, token_ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""
        new = after[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, len(token_ids)
        return new


def decode(tokenizer, token_ids: list[int]) -> str:
    """The text a completion returns: special tokens skipped (as vLLM returns it)."""
    if not token_ids:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=True)
