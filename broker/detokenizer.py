"""One sequence's output text, decoded as its tokens arrive (the incremental detokenization of vLLM
and TGI): a token costs the decode of a short window, not of the whole output, and when the sequence
ends its text is `tokenizer.decode(all_ids, skip_special_tokens=True)`, so nobody decodes it again.

Text is emitted once the window's decode no longer ends in U+FFFD, the mark of a character whose
UTF-8 bytes are still incomplete; emitted text never changes. The window starts one emission back
(`prefix_offset`), so tokenizers whose decode depends on the previous token (a SentencePiece word
start, for one) still decode the new tokens as the full decode would.
"""

from __future__ import annotations

from typing import Protocol

# What decode gives for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The part of a transformers tokenizer a detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of one growing sequence of token ids: `add` a token, read `visible`, `finish` at the end."""

    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # decode(ids[:read_offset]): final, never changes
        self.tail = ""  # decode(ids[read_offset:]) as it reads now; may change while it ends in U+FFFD
        self.prefix_offset = 0  # start of the decode window: the tokens of the last emission
        self.read_offset = 0  # tokens before this are in `text`
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), kept from the last emission

    @property
    def visible(self) -> str:
        """decode(ids) as it reads now: final text plus the tail still held back."""
        return self.text + self.tail

    def visible_from(self, start: int) -> str:
        """visible[start:], without copying the text before `start`."""
        return self.text[start:] + self.tail if start <= len(self.text) else self.tail[start - len(self.text):]

    def add(self, token_id: int) -> int:
        """Append a token; returns the index in `visible` before which nothing changed."""
        return self.extend([token_id])

    def extend(self, token_ids: list[int]) -> int:
        """Append tokens with one decode (a sequence with no stop strings needs its text only at the
        end, so it is fed once); returns the index in `visible` before which nothing changed."""
        unchanged = len(self.text)
        self.ids.extend(token_ids)
        window = self._decode(self.ids[self.prefix_offset:])
        self.tail = window[len(self._prefix_text):]
        if self.tail and not window.endswith(REPLACEMENT_CHAR):
            self._emit()
        return unchanged

    def finish(self) -> str:
        """The whole text; a character still incomplete at the end stays U+FFFD, as decode gives it."""
        if self.tail:
            self._emit()
        return self.text

    def _emit(self) -> None:
        """Make the tail final and start the next window at the tokens just emitted."""
        self.text += self.tail
        self.tail = ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
