"""Token ids for scoring, built exactly as lm-evaluation-harness's HF backend builds them, so our log-likelihoods are its.

Mirrors (lm-eval 0.4.x): `TemplateLM.loglikelihood` (an empty context becomes the model's prefix token),
`TemplateLM._encode_pair` (trailing context spaces move to the continuation; the pair is encoded whole and
split at the length of the encoded context), `HFLM.tok_encode` (the tokenizer's own special-token default,
overridden by add_bos_token, and no BOS added to a string that already starts with the prefix token's text),
`HFLM._loglikelihood_tokens` (left truncation to max_length + 1 tokens, last token dropped), and
`utils.get_rolling_token_windows` + `utils.make_disjoint_window` for rolling log-likelihood, and for generation
`HFLM.generate_until`'s prompt ids (`tok_batch_encode`: its own BOS rule, left truncation), its stop strings
(`handle_stop_sequences`: the decoded EOS is always one) and `HFLM.apply_chat_template` for chat messages.

The tokenizer is any object with `encode(text, add_special_tokens=...)`, `decode(ids)`, `bos_token_id` and
`eos_token_id` (a transformers tokenizer); nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, **kwargs) -> list[int]: ...

    def decode(self, ids: list[int] | int, **kwargs) -> str: ...


@dataclass(frozen=True)
class Encoder:
    """How one model turns text into the token ids lm-eval's HF backend would score."""

    # The model's tokenizer.
    tokenizer: Tokenizer
    # HFLM's add_bos_token: None keeps the tokenizer's own default; True/False forces special tokens on/off.
    add_bos_token: bool | None = None
    # HFLM's prefix_token_id argument; None means BOS, or EOS when the tokenizer has no BOS.
    custom_prefix_token_id: int | None = None

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and every rolling text) is conditioned on."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """HFLM.tok_encode: ids of text, with the special-token choice lm-eval makes."""
        kwargs = {}
        if add_special_tokens is not None:
            kwargs["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            kwargs["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and text.startswith(self.tokenizer.decode(self.prefix_token_id)):
            kwargs["add_special_tokens"] = False  # the text carries its own BOS already
        return list(self.tokenizer.encode(text, **kwargs))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as TemplateLM.loglikelihood builds them for one request."""
        if not continuation:
            raise ValueError(f"{continuation=} is empty: there is nothing to score")
        if context == "":
            continuation_ids = self.tok_encode(continuation, add_special_tokens=False)
            if continuation_ids[0] != self.prefix_token_id:
                return [self.prefix_token_id], continuation_ids
            return continuation_ids[:1], continuation_ids[1:]
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids):]

    def rolling_windows(self, text: str, max_length: int) -> list[tuple[list[int], list[int]]]:
        """The disjoint (context ids, continuation ids) windows lm-eval scores a rolling text in."""
        tokens = self.tok_encode(text)
        return [disjoint_window(w) for w in rolling_token_windows(tokens, self.prefix_token_id, max_length, 1)]

    def generation_ids(self, text: str, left_truncate_len: int) -> list[int]:
        """HFLM.tok_batch_encode for one generate_until prompt: its last left_truncate_len ids.

        Not tok_encode: generate_until's BOS check is against the tokenizer's bos_token text (not the prefix
        token's), and it ignores custom_prefix_token_id. Left padding in a batch only adds masked positions, so
        one prompt alone gets the same ids.
        """
        if left_truncate_len < 1:
            raise ValueError(f"{left_truncate_len=} leaves no room for the prompt")
        kwargs = {}
        bos_text = getattr(self.tokenizer, "bos_token", None)
        if bos_text is not None and text.startswith(bos_text):  # lm_eval.models.utils.has_bos_prefix
            kwargs["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            kwargs["add_special_tokens"] = self.add_bos_token
        return list(self.tokenizer.encode(text, **kwargs))[-left_truncate_len:]

    def stop_strings(self, until: tuple[str, ...] | list[str]) -> list[str]:
        """lm_eval.models.utils.handle_stop_sequences: until, then the decoded EOS unless until has it already."""
        stops = list(until)
        eos = self.tokenizer.eos_token_id
        eos_text = None if eos is None else self.tokenizer.decode(eos, skip_special_tokens=False)
        if eos_text is not None and eos_text not in stops:
            stops.append(eos_text)
        return stops

    def chat_text(self, messages: tuple[dict, ...] | list[dict], chat_template_args: dict | None = None) -> str:
        """HFLM.apply_chat_template with add_generation_prompt: the messages as the prompt text the model continues.

        As lm-eval does, a template that raises (many refuse a system role) is tried again without the system
        messages.
        """
        from jinja2 import TemplateError  # the tokenizer's template is Jinja2; imported here like the call itself

        apply = getattr(self.tokenizer, "apply_chat_template", None)
        if apply is None:
            raise ValueError(f"{type(self.tokenizer).__name__} has no apply_chat_template: chat messages need a "
                             "tokenizer with a chat template; give the prompt as text instead")
        kwargs = dict(tokenize=False, add_generation_prompt=True, continue_final_message=False,
                      **(chat_template_args or {}))
        try:
            return apply(list(messages), **kwargs)
        except TemplateError:
            return apply([m for m in messages if m["role"] != "system"], **kwargs)


def model_input(context_ids: list[int], continuation_ids: list[int], max_length: int) -> list[int]:
    """The ids the model runs on for one request: the pair left-truncated to max_length + 1 tokens, last dropped.

    The continuation's log-probabilities are read from the last len(continuation_ids) positions.
    """
    if not context_ids or not continuation_ids:
        raise ValueError(f"{len(context_ids)=} and {len(continuation_ids)=} must both be positive")
    if len(continuation_ids) > max_length:
        raise ValueError(f"{len(continuation_ids)=} exceeds {max_length=}: the continuation cannot be scored whole")
    return (context_ids + continuation_ids)[-(max_length + 1):][:-1]


def rolling_token_windows(
    tokens: list[int], prefix_token: int, max_seq_len: int, context_len: int
) -> Iterator[tuple[list[int], list[int]]]:
    """lm_eval.utils.get_rolling_token_windows: (input ids, predicted ids) covering every token once.

    The first window predicts up to max_seq_len tokens after the prefix token; each later window predicts the
    next max_seq_len - context_len + 1 tokens, conditioned on the tokens just before them.
    """
    if not 1 <= context_len <= max_seq_len:
        raise ValueError(f"need 1 <= {context_len=} <= {max_seq_len=}")
    if not tokens:
        return
    pred_len = max_seq_len - context_len + 1
    first_len = min(max_seq_len, len(tokens))
    yield [prefix_token] + tokens[: first_len - 1], tokens[:first_len]
    predicted = first_len
    while predicted < len(tokens):
        window_pred_len = min(len(tokens) - predicted, pred_len)
        end = predicted + window_pred_len
        # end > max_seq_len here (the first window predicted max_seq_len tokens), so the start is never negative.
        yield tokens[end - max_seq_len - 1: end - 1], tokens[end - window_pred_len: end]
        predicted += window_pred_len


def disjoint_window(pair: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """lm_eval.utils.make_disjoint_window: drop from the input the tokens the window also predicts."""
    inputs, predicted = pair
    return inputs[: len(inputs) - (len(predicted) - 1)], predicted
