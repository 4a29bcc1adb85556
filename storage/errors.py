"""The one exception the job store raises, and the URL masking every store message uses."""

from __future__ import annotations

import re

# user:password@ inside a URL; used when SQLAlchemy cannot parse the URL and so cannot mask it itself.
_PASSWORD_IN_URL = re.compile(r"(?P<scheme>://[^:/@]*):(?P<password>[^@/]*)@")


class StoreError(Exception):
    """A job-store operation that cannot be done as asked; str() names the values and the way out."""


def mask_url(url: str) -> str:
    """`url` with any password replaced by ***, safe to show in messages and logs."""
    # SQLAlchemy's own rendering would need a parsed URL; the regex also covers URLs it rejects.
    return _PASSWORD_IN_URL.sub(r"\g<scheme>:***@", url)
