"""A limit on every request body, enforced as the body arrives (ASGI middleware): a declared Content-Length over
it is refused before a byte is read, and a chunked body is cut off once it passes it. Uploads have their own,
larger limit, which the upload parser enforces with the file's line count (serve/uploads.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from layerbus.serve.errors import ApiError, error_response

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Wraps an ASGI app: bodies of `upload_path` may be `upload_bytes` long (plus the form's own), others `max_bytes`."""

    def __init__(self, app: App, max_bytes: int, upload_path: str, upload_bytes: int) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._upload_path = upload_path
        self._upload_bytes = upload_bytes + (1 << 16)  # the multipart framing around the file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._upload_bytes if scope["path"] == self._upload_path else self._max_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(scope, receive, send, limit)
            return
        seen = 0

        async def counted() -> Message:
            # Raised in the route that reads the body: the app's ApiError handler answers it.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(scope["path"], limit)
            return message

        await self._app(scope, counted, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        await error_response(too_large(scope["path"], limit))(scope, receive, send)


def too_large(path: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {limit:,} bytes for {path}: send less",
                    code="request_too_large")
