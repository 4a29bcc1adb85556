"""What `layerbus serve` is configured with: one value per option, and layerbus's own limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A batch input's most lines, and most bytes (OpenAI's own limits are 50,000 requests and 200 MB).
MAX_FILE_LINES = 1_000_000
MAX_FILE_BYTES = 1 << 30
# The most bytes of any other request body (a batch's JSON, a login form).
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServeConfig:
    """One server's settings."""

    # The job store's URL (SQLAlchemy form).
    db_url: str
    # Where uploaded and output files are kept, on this machine.
    files_dir: Path
    # When a request needs an API key: "required" (always: a bind other machines reach), "once_made" (once the
    # store holds a key, `layerbus keys api new`; before, requests act as the anonymous owner ""), "optional"
    # (--insecure: a request without a key acts as the anonymous owner; a key given is still checked).
    keys: str
    # Model directories lines may name by path or by directory name; prepared models are found by name anyway.
    models: tuple[Path, ...] = ()
    # Limits on an uploaded file, and on any other request body.
    max_file_lines: int = MAX_FILE_LINES
    max_file_bytes: int = MAX_FILE_BYTES
    max_body_bytes: int = MAX_BODY_BYTES
    # Seconds between the keeper's looks at open batches (expiry, output files).
    keeper_interval_s: float = 1.0
    # The longest completion window a batch may ask for, in seconds.
    max_window_s: float = 30 * 24 * 3600.0
