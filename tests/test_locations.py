"""Store URLs keep their meaning: ``location.redact`` and ``location.canonical`` cut out every credential and
nothing else, checked against libpq's own parser (``psycopg.conninfo.conninfo_to_dict``, which needs no server);
``location.secrets`` reads the credentials back as libpq does. Fast: no database, no model."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from kvmem.store import location

URLS = [
    # options with percent-encoded spaces and '=': libpq decodes %20, never '+'
    "postgresql://kv:pw@db:5432/mem?options=-c%20search_path%3Dapp",
    "postgresql://kv@db/mem?options=-c%20search_path%3Dapp%20-c%20statement_timeout%3D5s&password=s3cret",
    # unix-socket hosts: as a parameter, and percent-encoded in the authority
    "postgresql:///db?host=/run/pg&password=x",
    "postgresql:///db?host=%2Fvar%2Frun%2Fpg&user=me",
    "postgresql://%2Fvar%2Frun%2Fpg/db",
    # percent-encoded characters in the user, the password and a parameter
    "postgresql://k%C3%BCser:p%40ss%2Fw%3Ard%2B@db/mem?application_name=a%26b",
    # '+' is not a space to libpq
    "postgresql://kv@db/mem?password=a+b&application_name=x+y",
    # the parameter wins over the user part
    "postgresql://kv:one@db/mem?password=two",
    # sslpassword, alone and with other TLS settings; libpq's other secrets
    "postgresql://kv@db/mem?sslmode=require&sslpassword=s3cr%26t&sslkey=/keys/k.pem",
    "postgresql://kv@db/mem?sslpassword=only",
    "postgresql://kv@db/mem?oauth_client_secret=abc&oauth_client_id=app&oauth_issuer=https%3A%2F%2Fid.example",
    # several hosts, IPv6, no dbname
    "postgres://u:pw@h1:1,h2:2/db?target_session_attrs=read-write",
    "postgresql://kv:pw@[::1]:5433/db",
    "postgresql://db?dbname=mem&password=pw",
    # nothing to redact
    "postgresql://kv@db:5432/mem",
    "postgresql://",
]


@pytest.mark.parametrize("url", URLS)
def test_redaction_keeps_every_parameter_but_the_credentials(url):
    """What libpq reads from the redacted URL is what it reads from the URL, less the credentials; the credentials
    appear in it in no spelling; ``canonical`` is the same and redacting twice changes nothing; ``secrets`` and
    ``password`` give what libpq reads."""
    given = conninfo_to_dict(url)
    creds = {k: v for k, v in given.items() if k in location.PG_SECRETS}
    shown = location.redact(url)
    assert conninfo_to_dict(shown) == {k: v for k, v in given.items() if k not in location.PG_SECRETS}
    assert location.canonical(url) == shown and location.redact(shown) == shown
    for value in creds.values():
        for spelling in {value, quote(value, safe=""), quote(value), quote(value).replace("%20", "+")}:
            assert f"={spelling}" not in shown and f":{spelling}@" not in shown
    assert location.secrets(url) == {location.secret_env(k): v for k, v in creds.items()}
    assert location.password(url) == given.get("password")


def test_every_parameter_libpq_masks_is_a_secret():
    """libpq marks its password-like parameters (``dispchar`` ``*``); each is one that kvmem redacts."""
    masked = {o.keyword.decode() for o in pq.Conninfo.get_defaults() if o.dispchar == b"*"}
    assert {"password", "sslpassword"} <= masked <= set(location.PG_SECRETS)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/prefix", "s3://AKIAEXAMPLE@bucket/prefix"),
        ("s3://bucket/p?aws_secret_access_key=X&region=eu-west-1", "s3://bucket/p?region=eu-west-1"),
        ("az://c/p?sv=2022-11-02&sig=abc%2Bdef&se=2030", "az://c/p?sv=2022-11-02&se=2030"),
        ("https://h/b/o?X-Amz-Credential=a&X-Amz-Signature=b&X-Amz-Security-Token=c&x=1", "https://h/b/o?x=1"),
        ("gs://bucket/kv?service_account_key=e30", "gs://bucket/kv"),
        ("file:///mnt/shared/kv%20store", "file:///mnt/shared/kv%20store"),
        ("/not/a/url?password=x", "/not/a/url?password=x"),
    ],
)
def test_object_store_urls_lose_their_credentials_only(url, shown):
    assert location.redact(url) == shown


def test_the_other_credentials_reach_a_process_that_reopens_by_the_canonical_url(monkeypatch):
    """A worker opens a store by its canonical URL: the password comes from ``PGPASSWORD`` (libpq reads it), the
    other credentials from kvmem's variables (``secret_params``), and a credential in the URL itself wins."""
    url = "postgresql://kv:pw@db/mem?sslpassword=key%20pass&sslmode=require"
    env = location.secrets(url)
    assert env == {"PGPASSWORD": "pw", "KVMEM_PGSSLPASSWORD": "key pass"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert location.secret_params(location.canonical(url)) == {"sslpassword": "key pass"}
    assert location.secret_params(url) == {}
