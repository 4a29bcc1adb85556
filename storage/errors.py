"""The one exception the job store raises, and the URL masking every store message uses."""

from __future__ import annotations


class StoreError(Exception):
    """A job-store operation that cannot be done as asked; str() names the values and the way out."""


def mask_url(url: str) -> str:
    """`url` with any password replaced by ***, safe to show in messages and logs.

    Works on URLs SQLAlchemy rejects too. The last '@' before any '?' ends the credentials, so a
    password holding a raw '@' is masked whole (a database name with an '@' gets masked as well).
    """
    scheme, separator, rest = url.partition("://")
    at = rest.split("?", 1)[0].rfind("@")
    if not separator or at < 0 or ":" not in rest[:at]:
        return url
    user = rest[:at].split(":", 1)[0]
    return f"{scheme}://{user}:***@{rest[at + 1 :]}"
