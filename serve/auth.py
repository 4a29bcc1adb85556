"""API keys: made and hashed here, checked on every request. A key is a bearer token (`Authorization: Bearer
KEY`, what the `openai` client sends), or the dashboard's cookie set at its login. The store keeps only a key's
sha256 (a key is 256 random bits, so a fast hash is as strong as a slow one), and a request's key is found by it."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from layerbus.serve.errors import ApiError
from layerbus.storage.api_store import ApiStore

KEY_PREFIX = "lb-"
COOKIE = "layerbus_key"


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: the key's name (the owner of what it creates) and whether it sees everything."""

    owner: str
    admin: bool

    def sees(self, owner: str) -> bool:
        return self.admin or owner == self.owner


ANONYMOUS = Caller(owner="", admin=False)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header; None without one. Another scheme is refused."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "the Authorization header must be `Bearer KEY`; pass the key as the openai client's "
                            "api_key (or OPENAI_API_KEY)", code="invalid_api_key")
    return key.strip()


def authenticate(api: ApiStore, key: str | None, keys: str) -> Caller:
    """The caller a key stands for; ApiError 401 for a wrong, revoked or missing one (`keys`: ServeConfig.keys)."""
    if key is None:
        if keys == "required" or (keys == "once_made" and api.has_keys()):
            raise ApiError(401, "no API key given: send `Authorization: Bearer KEY` (the openai client's api_key); "
                                "`layerbus keys api new NAME` on the server's store makes one", code="missing_api_key")
        return ANONYMOUS
    found = api.key_by_hash(key_hash(key))
    if found is None and keys != "required" and not api.has_keys():
        return ANONYMOUS  # no key made yet: any key will do, as the openai client always sends one
    if found is None or found.revoked_at is not None:
        shown = key[:6] + "..." if len(key) > 8 else "..."
        why = "was revoked" if found is not None else "is not a key of this server"
        raise ApiError(401, f"the API key {shown} {why}: use a key `layerbus keys api new NAME` made for this "
                            "server's store", code="invalid_api_key")
    return Caller(owner=found.name, admin=found.admin)
