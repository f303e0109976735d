"""Tenants: API keys -> tenant, and each tenant's users in their own namespace of the store
(``"<tenant>:<user>"``, so the vLLM cache salt covers the tenant too)."""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .schemas import APIError

TENANT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def load_api_keys(path: str | Path) -> dict[str, str]:
    """``{"<key>": "<tenant>", ...}`` (JSON). Raises ValueError for an unreadable file, a short key or a tenant
    name other than ``[A-Za-z0-9_-]{1,64}``."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read API keys from {path}: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path} must be a JSON object of key -> tenant")
    for key, tenant in raw.items():
        if not isinstance(key, str) or len(key) < 16:
            raise ValueError(f"{path}: every key must be a string of at least 16 characters")
        if any(c.isspace() for c in key):  # a client can never present it: Authorization strips and splits on spaces
            raise ValueError(f"{path}: a key must not contain spaces or line breaks")
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise ValueError(f"{path}: tenant {tenant!r} must match [A-Za-z0-9_-]{{1,64}}")
    return dict(raw)


@dataclass
class Tenants:
    """Keys -> tenants. Without keys every caller is the one default tenant (the server then binds to loopback)."""

    keys: dict[str, str] = field(default_factory=dict)

    def tenant(self, authorization: str | None) -> str | None:
        if not self.keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() not in ("bearer", "token") or not given.strip():  # Token: mem0ai's MemoryClient
            raise APIError(401, "missing API key (Authorization: Bearer <key>)", "missing_api_key")
        given = given.strip().encode()
        found = None
        for key, tenant in self.keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", "invalid_api_key")
        return found

    @staticmethod
    def owns(tenant: str | None, store_user: str) -> bool:
        return tenant is None or store_user.startswith(f"{tenant}:")

    @staticmethod
    def public(tenant: str | None, store_user: str) -> str:
        return store_user if tenant is None else store_user[len(tenant) + 1 :]
