"""The memory inspector's sessions and its safety headers.

A session is a cookie (``COOKIE``: HttpOnly, SameSite=Strict, path ``/ui``) holding the tenant the API key
signed in as and the session's CSRF token, signed with itsdangerous (HMAC-SHA256) and timed (``MAX_AGE_S``).
The key itself is never stored, in the cookie or anywhere else. The signing secret is derived from every API
key (``KVMEM_UI_SECRET`` overrides it), so each replica behind the ingress accepts the others' sessions, and
a changed keys file ends every session. Signing out deletes the cookie and revokes its id in this process.

Every state-changing form carries the session's token in a hidden ``csrf`` field (``check_csrf``); signing in
carries the token of a pre-session cookie (``LOGIN_COOKIE``). ``SECURITY_HEADERS`` go on every ``/ui``
response: a Content-Security-Policy that allows the package's own scripts and styles only (no inline script),
no framing, no referrer, no caching.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass

from cachetools import TTLCache
from itsdangerous import BadSignature, URLSafeTimedSerializer

COOKIE = "kvmem_ui"
LOGIN_COOKIE = "kvmem_ui_login"
MAX_AGE_S = 12 * 3600
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Session:
    """A signed-in browser: its tenant (None: a server without keys), CSRF token and session id."""

    tenant: str | None
    csrf: str
    sid: str


class Sessions:
    """Issues and reads session cookies for one server (``keys``: its API keys -> tenants)."""

    def __init__(self, keys: dict[str, str]):
        secret = (
            os.environ.get("KVMEM_UI_SECRET")
            or hashlib.sha256(b"kvmem-ui\0" + json.dumps(sorted(keys.items())).encode()).hexdigest()
        )
        self._signer = URLSafeTimedSerializer(secret, salt="kvmem-ui-session")
        self._login = URLSafeTimedSerializer(secret, salt="kvmem-ui-login")
        self._revoked: TTLCache = TTLCache(maxsize=100_000, ttl=MAX_AGE_S)

    def issue(self, tenant: str | None) -> tuple[Session, str]:
        """A new session for ``tenant`` and its cookie value."""
        s = Session(tenant, secrets.token_urlsafe(24), secrets.token_urlsafe(12))
        return s, self._signer.dumps({"t": tenant, "c": s.csrf, "s": s.sid})

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie value holds, or None (absent, forged, expired, revoked)."""
        if not cookie:
            return None
        try:
            got = self._signer.loads(cookie, max_age=MAX_AGE_S)
        except BadSignature:
            return None
        if not isinstance(got, dict) or got.get("s") in self._revoked:
            return None
        return Session(got.get("t"), str(got.get("c")), str(got.get("s")))

    def revoke(self, session: Session) -> None:
        self._revoked[session.sid] = True

    def login_token(self) -> tuple[str, str]:
        """(the sign-in form's token, the pre-session cookie's value)."""
        token = secrets.token_urlsafe(24)
        return token, self._login.dumps(token)

    def login_ok(self, cookie: str | None, token: str | None) -> bool:
        """Whether a sign-in form's token matches its pre-session cookie (both from this server, 1 h at most)."""
        try:
            want = self._login.loads(cookie or "", max_age=3600)
        except BadSignature:
            return False
        return isinstance(want, str) and bool(token) and hmac.compare_digest(want, str(token))


def check_csrf(session: Session, token: str | None) -> bool:
    """Whether a form's ``csrf`` field is this session's token."""
    return bool(token) and hmac.compare_digest(session.csrf, str(token))
