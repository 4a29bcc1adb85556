"""An OpenAI batch input line as users write one, for the endpoint asked (`line(CHAT, logprobs=True)`)."""

from __future__ import annotations

import json

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(url: str, **body) -> str:
    content = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in url else {"prompt": "hi"}
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": {**content, **body}})
