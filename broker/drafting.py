"""Drafters: the tokens a decode row proposes for the last stage to verify (broker/speculation.py).

A drafter only guesses. Whatever it proposes, the last stage keeps a draft only where it equals the token it
picks anyway, so a drafter changes how many tokens a trip yields, never which tokens. Two drafters, neither
needing a model:
- prompt lookup: the sequence's last few tokens, looked up in its own prompt and output so far, propose what
  followed them there (summaries, translations and extractions copy spans of their input);
- the job's outputs: the same lookup in the outputs of the job's finished sequences (JSON keys, boilerplate
  and phrasing repeat from item to item), kept within a bound on tokens.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Drafter(Protocol):
    def propose(self, lookup: "SequenceLookup", limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow the sequence's tokens so far."""

    def finished(self, output: list[int]) -> None:
        """A sequence of the job ended with this output."""


class SequenceLookup:
    """One sequence's tokens (prompt, then output) and an index of its n-grams: for each n-gram that has a token
    after it, where its latest occurrence is followed. Grown token by token, so a lookup is a dict read."""

    def __init__(self, prompt: list[int], min_match: int, max_match: int):
        self.tokens: list[int] = []
        self.sizes = range(max_match, min_match - 1, -1)  # longest match first
        self.follows: dict[tuple[int, ...], int] = {}
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending just before the new token are now followed by it
            for n in self.sizes:
                if end >= n:
                    self.follows[tuple(self.tokens[end - n:end])] = end

    def matches(self) -> list[tuple[int, ...]]:
        """The n-grams the sequence ends with, longest first."""
        return [tuple(self.tokens[-n:]) for n in self.sizes if len(self.tokens) >= n]

    def propose(self, limit: int) -> list[int]:
        for gram in self.matches():
            at = self.follows.get(gram)
            if at is not None:
                return self.tokens[at:at + limit]
        return []


class PromptLookup:
    """Drafts from the sequence's own prompt and output (prompt lookup decoding)."""

    def propose(self, lookup: SequenceLookup, limit: int) -> list[int]:
        return lookup.propose(limit)

    def finished(self, output: list[int]) -> None:
        pass


class JobOutputs:
    """Drafts from the outputs of the job's finished sequences: the latest output with the longest match. Holds at
    most `max_tokens` tokens of outputs; the oldest are forgotten first."""

    def __init__(self, min_match: int, max_match: int, max_tokens: int = 1 << 18):
        self.sizes = range(max_match, min_match - 1, -1)
        self.max_tokens = max_tokens
        self.outputs: deque[tuple[int, list[int]]] = deque()  # (serial, tokens), oldest first
        self.held = 0
        self.serial = 0
        self.follows: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output serial, position after it)
        self.by_serial: dict[int, list[int]] = {}

    def finished(self, output: list[int]) -> None:
        if len(output) < 2 or len(output) > self.max_tokens:
            return
        self.serial += 1
        self.outputs.append((self.serial, output))
        self.by_serial[self.serial] = output
        self.held += len(output)
        for end in range(1, len(output)):
            for n in self.sizes:
                if end >= n:
                    self.follows[tuple(output[end - n:end])] = (self.serial, end)
        while self.held > self.max_tokens:
            serial, dropped = self.outputs.popleft()
            del self.by_serial[serial]
            self.held -= len(dropped)
        if len(self.follows) > 8 * self.max_tokens:  # entries of forgotten outputs: sweep them now and then
            self.follows = {gram: at for gram, at in self.follows.items() if at[0] in self.by_serial}

    def propose(self, lookup: SequenceLookup, limit: int) -> list[int]:
        for gram in lookup.matches():
            at = self.follows.get(gram)
            if at is not None and at[0] in self.by_serial:
                return self.by_serial[at[0]][at[1]:at[1] + limit]
        return []


class FirstOf:
    """The first drafter that has a draft (auto: the sequence's own tokens, then the job's outputs)."""

    def __init__(self, *drafters: Drafter):
        self.drafters = drafters

    def propose(self, lookup: SequenceLookup, limit: int) -> list[int]:
        for drafter in self.drafters:
            drafts = drafter.propose(lookup, limit)
            if drafts:
                return drafts
        return []

    def finished(self, output: list[int]) -> None:
        for drafter in self.drafters:
            drafter.finished(output)


def new_drafter(mode: str, min_match: int, max_match: int) -> Drafter | None:
    """The drafter of a speculation mode (planner.speculation.SPECULATE_MODES); None for off."""
    if mode == "off":
        return None
    if mode == "ngram":
        return PromptLookup()
    if mode == "suffix":
        return JobOutputs(min_match, max_match)
    return FirstOf(PromptLookup(), JobOutputs(min_match, max_match))
