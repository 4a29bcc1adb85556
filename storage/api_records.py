"""The records of `layerbus serve`'s API as the store keeps them: keys, files and batches (storage/api_store.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

# A batch's own status column (api_batches.status): while `submitted`, its state is its job's.
BATCH_VALIDATING = "validating"
BATCH_SUBMITTED = "submitted"
# Final statuses, written once the batch's files are written (or its input was refused).
BATCH_FINAL = ("completed", "failed", "cancelled", "expired")


@dataclass(frozen=True)
class ApiKey:
    """One API key as the server checks it: never its secret, only who it is."""

    # The name given at `layerbus keys api new NAME`; files and batches record it as their owner.
    name: str
    # Sees every key's files and batches.
    admin: bool
    created_at: datetime
    # When it was revoked; a revoked key is refused.
    revoked_at: datetime | None


@dataclass(frozen=True)
class ApiFile:
    """One stored file: an uploaded batch input, or a batch's output or error file."""

    # "file-" + 24 hex digits.
    id: str
    # The key name that created it ("" for a server that takes requests without keys).
    owner: str
    # The upload's file name (no folders), or the output file's name.
    filename: str
    # "batch" (an input) or "batch_output" (a batch's output or error file).
    purpose: str
    # Size in bytes, and JSON Lines in it.
    bytes: int
    lines: int
    # Where its bytes are, on the server's machine.
    path: str
    created_at: datetime


@dataclass(frozen=True)
class ApiBatch:
    """One batch as the store keeps it; its live state and counts come from its job once it has one."""

    # "batch_" + 24 hex digits.
    id: str
    # The key name that created it ("" without keys).
    owner: str
    input_file_id: str
    # "/v1/chat/completions" or "/v1/completions".
    endpoint: str
    # As given ("24h"), and the time it ends.
    completion_window: str
    expires_at: datetime
    # The user's metadata object as JSON text.
    metadata_json: str
    # validating, submitted, or one of BATCH_FINAL.
    status: str
    # The job its items run as, once its input passed validation.
    job_id: str | None
    # OpenAI's errors.data list as JSON text, when the input was refused.
    errors_json: str | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    cancelling_at: datetime | None
    expired_at: datetime | None
    finished_at: datetime | None
