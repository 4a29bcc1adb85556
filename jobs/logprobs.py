"""Log-probabilities of an item's output as OpenAI's chat `choice.logprobs` object, the form the store and the
Parquet keep (JSON text); `completions_logprobs` rewrites it in /v1/completions' legacy form for the output file."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `layerbus results --format openai` imports this module and stays light
    from layerbus.broker.requests import GenerationResult


def logprobs_json(result: GenerationResult) -> str | None:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal":
    null} for a result that carries logprobs, else None. With the prompt's log-probabilities (an item that
    asked for prompt_logprobs) also "prompt": [null, {"token", "logprob", "bytes"}, ...], one per prompt token,
    the first null (nothing comes before it), as vLLM's prompt_logprobs; "content" is then null unless the
    output's log-probabilities were asked for too."""
    if result.logprobs is None and result.prompt_logprobs is None:
        return None
    texts = result.token_texts or {}
    tops = result.top_logprobs or [[] for _ in result.token_ids]

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts.get(token, "")
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = None if result.logprobs is None else [
        {**entry(token, logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}
        for token, logprob, top in zip(result.token_ids, result.logprobs, tops)]
    stored: dict[str, Any] = {"content": content, "refusal": None}
    if result.prompt_logprobs is not None:
        prompt = result.prompt_ids or []
        stored["prompt"] = [None] + [entry(token, logprob) for token, logprob in zip(prompt[1:], result.prompt_logprobs)]
    return json.dumps(stored, ensure_ascii=False)


def completions_logprobs(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat form rewritten as /v1/completions' {tokens, token_logprobs, top_logprobs, text_offset}."""
    content = chat.get("content") or []
    offsets, at = [], 0
    for item in content:
        offsets.append(at)
        at += len(item["token"])
    return {"tokens": [item["token"] for item in content], "token_logprobs": [item["logprob"] for item in content],
            "top_logprobs": [{top["token"]: top["logprob"] for top in item["top_logprobs"]} for item in content],
            "text_offset": offsets}
