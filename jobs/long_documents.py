"""Documents longer than the model's context: cut into pieces on paragraph and sentence boundaries, measured
in tokens, and the tree of items that makes one result per document from them.

Pure: the caller passes the token counter (the job's tokenizer) and gets back texts and a plan. The
storing and running are elsewhere (jobs/document_split.py at submit, storage/document_parts.py as parts
finish, jobs/store_io.py for a reduce's prompt).

- summarize: each piece is summarized (map), then the summaries are summarized in order (reduce). When
  they do not fit one reduce prompt, reduces of `fan_in` summaries each make a level, and so on up to
  the document's own item: a tree of depth ceil(log_fan_in(pieces)).
- translate: each piece is translated and the pieces are joined in order (no model call); pieces do not
  overlap, as overlapping text would be translated twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

# Choices of --long-documents; split is the default for summarize and translate, fail for generate.
LONG_DOCUMENT_MODES = ("split", "fail", "truncate")
# What a reduce asks, around the summaries it combines; a user's --reduce-template replaces it.
REDUCE_TEMPLATE = ("The following are summaries of consecutive parts of one document, in order. Combine them "
                   "into one summary of the whole document in a few sentences.\n\n{summaries}")
# How each summary is set out in a reduce prompt.
SUMMARY_HEADING = "Part {number}:\n{summary}"

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")
_SENTENCE_END = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+")


@dataclass(frozen=True)
class Piece:
    """One piece of a document's text, and what joins it to the piece before it."""

    # The text the piece's prompt is made with.
    text: str
    # What goes between the previous piece's output and this one's when outputs are joined: a paragraph
    # break where the text had one, a space inside a paragraph; "" for the first piece.
    join_before: str


def split_text(text: str, count: Callable[[str], int], max_tokens: int, overlap_tokens: int = 0) -> list[Piece]:
    """The text in pieces of at most max_tokens tokens each (as `count` measures them), cut at paragraph
    breaks where a paragraph fits, else at sentence ends, else at spaces; each piece after the first
    starts with up to overlap_tokens of the previous piece's last sentences."""
    if max_tokens < 1:
        raise ValueError(f"pieces need at least one token, got {max_tokens=}")
    units = [_Unit(sentence, count(sentence), starts_paragraph=(i == 0))
             for paragraph in _PARAGRAPH_BREAK.split(text.strip()) if paragraph.strip()
             for i, sentence in enumerate(_fitting(paragraph.strip(), count, max_tokens))]
    pieces: list[list[_Unit]] = [[]]
    for unit in units:
        current = pieces[-1]
        if current and _tokens(current + [unit]) > max_tokens:
            pieces.append(_overlap(current, overlap_tokens, max_tokens - unit.tokens) + [unit])
        else:
            current.append(unit)
    pieces = [piece for piece in pieces if piece]
    return [Piece(_joined(piece), "" if i == 0 else _join_before(piece)) for i, piece in enumerate(pieces)]


@dataclass(frozen=True)
class _Unit:
    text: str
    tokens: int
    starts_paragraph: bool
    overlap: bool = False


def _tokens(units: list[_Unit]) -> int:
    # One token more per unit for the space or break between units: pieces stay within budget.
    return sum(unit.tokens + 1 for unit in units)


def _fitting(paragraph: str, count: Callable[[str], int], max_tokens: int) -> list[str]:
    """A paragraph as one unit when it fits, else its sentences, else its sentences' words grouped."""
    if count(paragraph) < max_tokens:
        return [paragraph]
    out = []
    for sentence in (s for s in _SENTENCE_END.split(paragraph) if s.strip()):
        if count(sentence) < max_tokens:
            out.append(sentence.strip())
            continue
        words, current = sentence.split(), ""
        for word in words:
            candidate = f"{current} {word}" if current else word
            if current and count(candidate) >= max_tokens:
                out.append(current)
                candidate = word
            current = candidate
        out += [current] if current else []
    return [cut for unit in out for cut in _character_cuts(unit, count, max_tokens)]


def _character_cuts(unit: str, count: Callable[[str], int], max_tokens: int) -> list[str]:
    """A single "word" longer than a piece (a URL, a base64 blob) in runs of characters that fit; nothing
    of it is dropped."""
    cuts = []
    while count(unit) >= max_tokens and len(unit) > 1:
        size = max(1, len(unit) * (max_tokens - 1) // max(count(unit), 1))
        while size > 1 and count(unit[:size]) >= max_tokens:
            size = max(1, size * 3 // 4)
        cuts.append(unit[:size])
        unit = unit[size:]
    return cuts + [unit]


def _overlap(previous: list[_Unit], overlap_tokens: int, room: int) -> list[_Unit]:
    """The last sentences of the previous piece that fit in overlap_tokens (and the room left)."""
    taken: list[_Unit] = []
    for unit in reversed(previous):
        if _tokens(taken + [unit]) > min(overlap_tokens, room - 1) or len(taken) + 1 >= len(previous):
            break
        taken.insert(0, _Unit(unit.text, unit.tokens, unit.starts_paragraph, overlap=True))
    return taken


def _joined(units: list[_Unit]) -> str:
    text = units[0].text
    for unit in units[1:]:
        text += ("\n\n" if unit.starts_paragraph else " ") + unit.text
    return text


def _join_before(piece: list[_Unit]) -> str:
    first_new = next(unit for unit in piece if not unit.overlap)
    return "\n\n" if first_new.starts_paragraph else " "


def reduce_tree(pieces: int, fan_in: int) -> list[list[int]]:
    """The reduce levels over `pieces` map outputs: for each level from 1 up, how many outputs of the level
    below each of its reduces takes, in order; the last level has one reduce (the document's own item)."""
    if pieces < 1 or fan_in < 2:
        raise ValueError(f"a reduce tree needs pieces >= 1 and fan_in >= 2, got {pieces=}, {fan_in=}")
    levels, width = [], pieces
    while True:
        groups = math.ceil(width / fan_in)
        # Even groups rather than full ones and a remainder: 7 by 3 is 3, 2, 2 rather than 3, 3, 1.
        sizes = [width // groups + (1 if i < width % groups else 0) for i in range(groups)]
        levels.append(sizes)
        if groups == 1:
            return levels
        width = groups


def reduce_fan_in(budget_tokens: int, template_tokens: int, summary_tokens: int) -> int:
    """How many summaries of at most summary_tokens one reduce prompt of budget_tokens holds, after its
    template's own tokens (each summary with its heading); at least 2."""
    heading = 8  # "Part 12:\n" and the break before it
    return max(2, (budget_tokens - template_tokens) // (summary_tokens + heading))


def reduce_prompt_text(summaries: list[str], template: str = REDUCE_TEMPLATE) -> str:
    """The user message of a reduce: the template with its summaries set out in order."""
    parts = "\n\n".join(SUMMARY_HEADING.format(number=i, summary=s.strip()) for i, s in enumerate(summaries, 1))
    return template.replace("{summaries}", parts)
