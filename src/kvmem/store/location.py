"""Where a store is: its location (a directory or a ``postgresql://`` URL), spelled without credentials for
messages and engine configs, and the errors a store raises.

URLs are rewritten as libpq reads them (``psycopg.conninfo.conninfo_to_dict``, tested against it), never through
a generic URL parser: only the credentials are cut out, and every other byte stays as written, so percent
escapes (``options=-c%20search_path%3Dapp``; libpq does not read ``+`` as a space), unix-socket hosts
(``postgresql:///db?host=/run/pg``) and the order of parameters keep their meaning.

``redact`` / ``canonical`` never return a credential; ``secrets`` is the one place that reads them back out of a
URL, as the environment variables through which the processes that reopen a store by its canonical URL get them
(``PGPASSWORD`` for the password, which libpq reads itself; ``secret_params`` reads the others back).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

POSTGRES_SCHEMES = ("postgresql", "postgres")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
# libpq's parameters that carry a credential: the ones libpq itself masks (dispchar "*": password, sslpassword,
# oauth_client_secret) and the SCRAM keys, which authenticate as the password does. A test checks that libpq
# masks nothing else.
PG_SECRETS = ("password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key")
# In other URLs (segments: s3://, gs://, az://, https://): query parameters named like a credential (Azure SAS
# ``sig``, ``X-Amz-Signature`` / ``-Credential`` / ``-Security-Token``, ``*_key``, ``client_secret``, ...)
_SECRET_NAME = re.compile(r"(?i)^(sig|.*(pass|secret|token|signature|credential|key|sas).*)$")


class StoreError(RuntimeError):
    """Missing or unreadable store, unknown user, unreachable database."""


class StoreBusy(StoreError):
    """A write waited longer than the store's ``write_timeout_s`` for another writer's lock."""


class StoreUnavailable(StoreError):
    """The store's database cannot be reached (down, restarting, a network cut): try again later."""


class StoreConflict(StoreError):
    """A compare-and-set commit found a memory changed since it was read (another writer, maybe on another
    machine, updated or deleted it first). Nothing was written; read it again and retry."""


class UnknownUser(StoreError):
    """The user has no live memories in this store (never written, or every fact deleted)."""


class StoreMismatch(StoreError):
    """The store's KV was produced by a different model, tokenizer, dtype or RoPE config."""


class StoreDtypeMismatch(StoreMismatch):
    """Same model, but the store's KV was computed in another dtype than the one serving it."""


def is_url(location: str | Path) -> bool:
    return bool(_URL.match(str(location)))


def is_postgres(location: str | Path) -> bool:
    """Whether ``location`` is a PostgreSQL URL (``postgresql://…`` or ``postgres://…``): the one rule."""
    return is_url(str(location)) and _postgres_scheme(str(location))


def _postgres_scheme(text: str) -> bool:
    """Whether ``text`` (a URL, or its ``scheme:`` part) starts with a PostgreSQL scheme."""
    return text.split(":", 1)[0].lower() in POSTGRES_SCHEMES


def _parts(url: str) -> tuple[str, str, str, str | None]:
    """``url`` split as libpq splits a connection URI: (``scheme://``, userinfo, the rest up to ``?``, the query
    or None). The userinfo is what comes before the first ``@`` ahead of the first ``/`` (libpq's own rule), so a
    percent-encoded ``@`` in a password never splits it. Raw text, nothing decoded."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # file:/x, postgresql:/x: no authority
        scheme, _, rest = url.partition(":")
        sep = ":"
    head = rest.split("/", 1)[0]
    userinfo = ""
    if "@" in head:
        userinfo, rest = rest.split("@", 1)
    body, q, query = rest.partition("?")
    return scheme + sep, userinfo, body, query if q else None


def _is_secret(scheme: str, key: str) -> bool:
    if _postgres_scheme(scheme):
        return key in PG_SECRETS
    return bool(_SECRET_NAME.match(key))


def redact(url: str) -> str:
    """``url`` without its credentials (a password in the user part; ``password=``, ``sslpassword=`` and libpq's
    other secrets as parameters; credential-named parameters of an object-store URL), for messages and engine
    configs: ``postgresql://kv@db:5432/kvmem?options=...``. Everything else is kept byte for byte."""
    if not is_url(url):
        return url
    scheme, userinfo, body, query = _parts(url)
    if userinfo:
        userinfo = userinfo.split(":", 1)[0] + "@"
    if query is not None:
        kept = [p for p in query.split("&") if not _is_secret(scheme, unquote(p.split("=", 1)[0]))]
        query = "&".join(kept) if kept else None
    return scheme + userinfo + body + ("" if query is None else "?" + query)


def redact_text(text: str) -> str:
    """``text`` with every URL in it ``redact``-ed: for logs and messages that quote a URL (httpx's, obstore's)."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://\S+", lambda m: redact(m.group(0)), text)


def has_credentials(url: str | None) -> bool:
    """Whether ``url`` carries a credential that ``redact`` would remove (a password in its user part, a
    credential-named query parameter)."""
    return bool(url) and is_url(url) and redact(url) != url


def canonical(location: str | Path) -> str:
    """One spelling per store: a URL without its credentials (``redact``: libpq reads a password from
    ``PGPASSWORD`` or ``~/.pgpass``; see ``secrets``), a directory as its absolute resolved path. What goes into an
    engine's configuration, which engines log."""
    return redact(str(location)) if is_url(location) else str(Path(location).resolve())


def _secret_values(location: str | Path) -> dict[str, str]:
    """The credentials in a ``postgresql://`` URL as libpq reads them (decoded; a parameter wins over the user
    part, as in libpq). Empty for anything else."""
    text = str(location)
    if not is_postgres(text):
        return {}
    scheme, userinfo, _, query = _parts(text)
    out = {}
    if ":" in userinfo:
        out["password"] = unquote(userinfo.split(":", 1)[1])
    for p in (query or "").split("&"):
        key, _, value = p.partition("=")
        if unquote(key) in PG_SECRETS:
            out[unquote(key)] = unquote(value)
    return out


def secret_env(key: str) -> str:
    """The environment variable that carries libpq parameter ``key`` (one of ``PG_SECRETS``) to a process that opens
    a store by its canonical URL: libpq's own ``PGPASSWORD`` for the password, else ``KVMEM_PG<KEY>``
    (``KVMEM_PGSSLPASSWORD``; libpq has no variable for those)."""
    return "PGPASSWORD" if key == "password" else f"KVMEM_PG{key.upper()}"


def secrets(location: str | Path) -> dict[str, str]:
    """The credentials of a store URL as environment variables (``secret_env``: value), for processes that reopen
    the store by its canonical URL: set them in the environment those processes inherit, never in a config."""
    return {secret_env(k): v for k, v in _secret_values(location).items()}


def secret_params(location: str | Path) -> dict[str, str]:
    """Connection parameters for a PostgreSQL URL from ``secrets``' environment variables, for those the URL does
    not carry and libpq does not read from the environment itself (all but the password)."""
    given = _secret_values(location)
    return {
        k: os.environ[secret_env(k)]
        for k in PG_SECRETS
        if k != "password" and k not in given and os.environ.get(secret_env(k))
    }


def password(location: str | Path) -> str | None:
    """The password in a store URL (``user:pw@`` or ``?password=``, the latter winning as in libpq), decoded."""
    return _secret_values(location).get("password")


def within(location: str | Path, allowed: list[str]) -> bool:
    """Whether ``location`` is one of the ``allowed`` (canonical) locations, or a directory below one."""
    loc = canonical(location)
    if is_url(loc):
        return loc in allowed
    return any(loc == a or Path(a) in Path(loc).parents for a in allowed if not is_url(a))
