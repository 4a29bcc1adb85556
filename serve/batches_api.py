"""OpenAI's Batch API: create a batch from an uploaded file, retrieve it, cancel it, list them.

A batch is a layerbus job: creating one answers at once with the batch `validating` while its input is read into
a job on the server's intake thread (serve/batch_intake.py); brokers of its model then run it as any queued job,
and the keeper (serve/batch_keeper.py) expires it or writes its files. A key sees only its own batches.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from layerbus.serve.batch_intake import BatchRefused, error_entry, submit_batch_job
from layerbus.serve.batch_keeper import cancel_job_quietly
from layerbus.serve.batch_view import batch_object
from layerbus.serve.errors import ApiError
from layerbus.serve.files_api import owned_file
from layerbus.serve.server import Server, new_id
from layerbus.storage.api_records import BATCH_SUBMITTED, BATCH_VALIDATING, ApiBatch, ApiFile
from layerbus.storage.errors import StoreError

LOG = logging.getLogger(__name__)
router = APIRouter()
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's limits on a batch's metadata.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchRequest(BaseModel):
    """POST /v1/batches' body."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def window_seconds(window: str, longest_s: float) -> float:
    """A completion window's seconds ("24h", "90m", "2d", "30s"); ApiError 400 naming the forms it takes."""
    found = _WINDOW.match(window)
    seconds = int(found.group(1)) * _UNIT_S[found.group(2)] if found else None
    if seconds is None or seconds > longest_s:
        raise ApiError(400, f"completion_window {window!r} is not one this server takes: give a whole number of "
                            f"seconds, minutes, hours or days up to {longest_s / 3600:g}h, such as '24h'",
                       code="invalid_completion_window", param="completion_window")
    return float(seconds)


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                                 for k, v in metadata.items()):
        raise ApiError(400, f"metadata takes at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} "
                            f"characters and values of at most {MAX_METADATA_VALUE}", code="invalid_metadata",
                       param="metadata")
    return metadata


def view(server: Server, batch: ApiBatch) -> dict[str, Any]:
    job = server.store.job_status(batch.job_id) if batch.job_id is not None else None
    return batch_object(batch, job)


def owned_batch(server: Server, request: Request, batch_id: str) -> ApiBatch:
    caller = server.caller(request)
    batch = server.api.batch(batch_id)
    if batch is None or not caller.sees(batch.owner):
        raise ApiError(404, f"no batch {batch_id!r} for this key: GET /v1/batches lists yours",
                       code="batch_not_found", param="batch_id")
    return batch


@router.post("/v1/batches")
def create_batch(request: Request, body: BatchRequest) -> dict[str, Any]:
    server: Server = request.app.state.server
    caller = server.caller(request)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint {body.endpoint!r} is not one layerbus runs: use {' or '.join(ENDPOINTS)}",
                       code="invalid_endpoint", param="endpoint")
    window_s = window_seconds(body.completion_window, server.config.max_window_s)
    metadata = check_metadata(body.metadata)
    input_file = owned_file(server, request, body.input_file_id)
    if input_file.purpose != "batch":
        raise ApiError(400, f"file {input_file.id!r} has purpose {input_file.purpose!r}: a batch's input is a file "
                            "uploaded with purpose='batch'", code="invalid_input_file", param="input_file_id")
    now = server.now()
    batch = ApiBatch(id=new_id("batch_"), owner=caller.owner, input_file_id=input_file.id, endpoint=body.endpoint,
                     completion_window=body.completion_window, expires_at=now + timedelta(seconds=window_s),
                     metadata_json=json.dumps(metadata), status=BATCH_VALIDATING, job_id=None, errors_json=None,
                     output_file_id=None, error_file_id=None, created_at=now, cancelling_at=None, expired_at=None,
                     finished_at=None)
    server.api.add_batch(batch)
    server.validating.add(batch.id)
    server.intake.submit(validate, server, batch, input_file)
    return batch_object(batch, None)


def validate(server: Server, batch: ApiBatch, input_file: ApiFile) -> None:
    """On the intake thread: the batch's input into a job, or the batch failed with errors.data."""
    from pathlib import Path

    try:  # the batch leaves `validating` before this process stops saying it validates it (the keeper reads both)
        job_id = submit_batch_job(server.store, Path(input_file.path), batch.endpoint, batch.id, server.config.models)
        server.api.update_batch(batch.id, status=BATCH_SUBMITTED, job_id=job_id)
    except BatchRefused as refused:
        _failed(server, batch, refused.errors)
        return
    except Exception as error:  # a bad model directory, an unreadable file: the batch says why
        LOG.exception("validating batch %s failed", batch.id)
        _failed(server, batch, [error_entry(f"{type(error).__name__}: {error}", code="validation_failed")])
        return
    finally:
        server.validating.discard(batch.id)
    now_batch = server.api.batch(batch.id)
    if now_batch is not None and (now_batch.cancelling_at is not None or now_batch.expired_at is not None):
        cancel_job_quietly(server, job_id)


def _failed(server: Server, batch: ApiBatch, errors: list[dict[str, Any]]) -> None:
    server.api.update_batch(batch.id, status="failed", errors_json=json.dumps(errors), finished_at=server.now())


@router.get("/v1/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
    server: Server = request.app.state.server
    return view(server, owned_batch(server, request, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    server: Server = request.app.state.server
    batch = owned_batch(server, request, batch_id)
    if batch.status not in (BATCH_VALIDATING, BATCH_SUBMITTED):
        raise ApiError(400, f"batch {batch_id!r} is {batch.status}: only a validating or running batch can be "
                            "cancelled", code="batch_not_cancellable")
    if batch.cancelling_at is None:
        server.api.update_batch(batch.id, cancelling_at=server.now())
    batch = server.api.batch(batch.id) or batch
    if batch.job_id is not None:
        try:
            server.store.cancel_job(batch.job_id)
        except StoreError as error:  # finalizing already, or cancelled by the intake just now
            LOG.info("batch %s: %s", batch.id, error)
    return view(server, batch)


@router.get("/v1/batches")
def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict[str, Any]:
    server: Server = request.app.state.server
    caller = server.caller(request)
    found = server.api.batches(None if caller.admin else caller.owner, limit + 1, after)
    page = [view(server, batch) for batch in found[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit}
