"""What `layerbus submit` stores in an item's params_json: the user's overrides, plus how to tokenize
the rendered prompt. Light on purpose: submit imports it, and must import neither the broker nor torch."""

from __future__ import annotations

from typing import Any

# Key added next to the user's overrides: how render_prompt said to tokenize the prompt.
ADD_SPECIAL_TOKENS_KEY = "add_special_tokens"
# Token ids given by whoever queued the item (evals tokenize as lm-evaluation-harness does): used as is.
PROMPT_IDS_KEY = "prompt_ids"


# The OpenAI endpoint the input line named, kept so the OpenAI-form output answers in that endpoint's form.
ENDPOINT_KEY = "endpoint"


def item_params(overrides: dict[str, Any], add_special_tokens: bool, endpoint: str | None = None) -> dict[str, Any]:
    """An item's stored params: the user's overrides plus what the job runner needs to rebuild the request,
    and the OpenAI endpoint its line named (when it was an OpenAI batch line).

    The item's position is not among them: it is the items.seq column (stores made by an older
    layerbus also have it here as "seq", which nothing reads)."""
    params = {**overrides, ADD_SPECIAL_TOKENS_KEY: add_special_tokens}
    if endpoint is not None:
        params[ENDPOINT_KEY] = endpoint
    return params
