"""Errors a client can cause, answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with
OpenAI's status codes, so the `openai` client raises its own exception classes (AuthenticationError,
NotFoundError, BadRequestError, ...) with the message. Every message names the problem and the way out."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

LOG = logging.getLogger(__name__)
# OpenAI's error.type for each status this server answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error", 500: "server_error"}


class ApiError(Exception):
    """A request refused: its HTTP status, OpenAI's error code, the parameter at fault, and what to do."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error_body(error.status, error.message, error.code, error.param), status_code=error.status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every refusal, FastAPI's own included (a missing field, an unknown path), in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(error.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"no such route {request.method} {request.url.path}; this server has /v1/files and /v1/batches"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return error_response(ApiError(error.status_code, message))

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception) -> JSONResponse:
        LOG.exception("%s %s failed", request.method, request.url.path)
        return error_response(ApiError(500, f"the server failed on {request.method} {request.url.path} "
                                            f"({type(error).__name__}); its log has the traceback"))


def validation_error(problems: list[dict[str, Any]]) -> ApiError:
    """FastAPI's validation problems as one 400: the first field at fault named as `param`, each problem said."""
    said = []
    for problem in problems:
        where = ".".join(str(part) for part in problem.get("loc", ()) if part not in ("body", "query", "path"))
        said.append(f"{where or 'the request'}: {problem.get('msg', 'invalid')}")
    first = problems[0].get("loc", ()) if problems else ()
    param = str(first[-1]) if first else None
    return ApiError(400, "; ".join(said) + " (see the OpenAI API reference for the request's fields)",
                    code="invalid_request", param=param)
