"""Grammar state for constrained decoding, with llguidance: which tokens each constrained sequence may take next.

The broker owns it, beside the sequence's generated tokens: a stage lost or a re-prefill changes nothing here,
and `TokenGrammar.rebuild` replays the generated tokens anyway after a re-plan, so the masks, and with them the
outputs, are those of an uninterrupted run. Imported only when a job has a constrained item (the broker's
`_new_grammar`), and by `layerbus submit` to check a constraint: llguidance needs neither torch nor
transformers, so the light commands stay light. Why llguidance and not xgrammar: docs/jobs.md, "Constrained decoding".
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import llguidance

from layerbus.wire.constraint import Constraint

# JSON as models usually write it and as json.dumps does: ", " and ": ", no other whitespace. Flexible
# whitespace lets a small model pad an object with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint (not yet checked: see check_constraint)."""
    if constraint.kind in ("json_schema", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema, defaults=JSON_OPTIONS)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.value)
    # Lark string literals take JSON's escapes, so any choice text is quoted exactly.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))


@lru_cache(maxsize=4096)
def check_constraint(constraint: Constraint) -> str | None:
    """Why the engine cannot compile this constraint, or None when it can (cached: a million items often
    share one schema)."""
    if constraint.kind == "choice" and not (constraint.choices and all(constraint.choices)):
        return "choices must be a non-empty list of non-empty strings"
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    except ValueError as failed:
        error = str(failed)
    return error or None


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it (about a second to build, so once per broker) and the
    grammars compiled so far."""

    def __init__(self, model_dir: str | Path, eos_ids: set[int], vocab_size: int):
        path = Path(model_dir) / "tokenizer.json"
        try:
            tokenizer_json = path.read_text(encoding="utf-8")
        except OSError as error:  # a ValueError fails the constrained requests, not the run
            raise ValueError(f"constrained decoding needs the model's {path} (a fast tokenizer's file): {error}; "
                             "save the tokenizer with transformers' save_pretrained to write it") from None
        # n_vocab: the logits' width, so a mask covers every token the head can score (padding rows included).
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._grammars: dict[Constraint, str] = {}

    def new(self, constraint: Constraint) -> "TokenGrammar":
        """A fresh grammar state for one sequence; ValueError naming the problem when it does not compile."""
        grammar = self._grammars.get(constraint)
        if grammar is None:
            error = check_constraint(constraint)
            if error:
                raise ValueError(f"the {constraint.kind} constraint does not compile: {error}")
            grammar = self._grammars[constraint] = grammar_text(constraint)
        return TokenGrammar(llguidance.LLMatcher(self.tokenizer, grammar, log_level=0))


class TokenGrammar:
    """One sequence's grammar state: the mask for its next token, advanced by each token it takes."""

    def __init__(self, matcher: "llguidance.LLMatcher"):
        self.matcher = matcher
        self.consumed = 0  # tokens taken so far; the cached mask is for this count
        self._mask: tuple[int, bytes] | None = None

    def mask(self) -> bytes:
        """The allow-bitmask for the next token (cached: a resent step asks again)."""
        if self._mask is None or self._mask[0] != self.consumed:
            self._mask = (self.consumed, self.matcher.compute_bitmask())
        return self._mask[1]

    def advance(self, token: int) -> str | None:
        """Take the token the last stage chose; the reason when the grammar refuses it (a stage that
        ignored the mask), else None."""
        self.consumed += 1
        if self.matcher.consume_token(token):
            return None
        return f"token {token} breaks the constraint ({self.matcher.get_error()})"

    def lookahead(self, drafts: list[int]) -> tuple[int, list[bytes]]:
        """How many of `drafts` the grammar allows one after another, and the mask at the position after each
        allowed one (the masks the last stage verifies those positions with); the state is left as it was."""
        allowed = self.matcher.validate_tokens(drafts) if drafts else 0
        masks = []
        taken = 0
        for token in drafts[:allowed]:
            if not self.matcher.consume_token(token):
                break
            taken += 1
            masks.append(self.matcher.compute_bitmask())
        if taken:
            self.matcher.rollback(taken)
        return taken, masks

    def rebuild(self, tokens: list[int]) -> str | None:
        """Start over and take `tokens` again: the state after a re-plan is a function of the tokens alone."""
        self.matcher.reset()
        self.consumed = len(tokens)
        if not tokens or self.matcher.consume_tokens(tokens):
            return None
        return f"the generated tokens break the constraint ({self.matcher.get_error()})"
