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


SEGMENTS_WITH_KEYS = [
    "s3://AKIAEXAMPLE:wJalrXUtnFEMIK7MDENG@minio:9000/kv",
    "https://acct.blob.core.windows.net/kv?sv=2024&sig=wJalrXUtnFEMIK7MDENG",
    "s3://kv/prefix?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=wJalrXUtnFEMIK7MDENG",
]


@pytest.mark.parametrize("url", SEGMENTS_WITH_KEYS)
def test_a_segments_url_with_credentials_is_refused_before_anything_records_it(url, tmp_path):
    """``--segments`` with credentials: a new store refuses it (its manifest would keep the URL, read by every
    process that opens the store), and so does ``kvmem serve`` on Ray (the replicas' arguments), each with one
    line that names neither secret; nothing is created. The old code wrote the URL into the manifest."""
    import torch

    from kvmem.server.replicas import refuse_secrets
    from kvmem.store import Store, StoreError

    with pytest.raises(StoreError, match="carries credentials") as err:
        header = torch.zeros(2, 1, 3, 64)
        Store.create(
            tmp_path / "s", {"model": "m"}, "h", [1], header, header, {"name": "e", "dim": 4}, segments_url=url
        )
    assert "wJalrXUtnFEMIK7MDENG" not in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "s" / "manifest.json").exists()
    with pytest.raises(ValueError, match="carries credentials") as err:
        refuse_secrets({"segments_url": url})
    assert "wJalrXUtnFEMIK7MDENG" not in str(err.value) and "AKIAEXAMPLE:" not in str(err.value)


def test_an_extractor_key_never_reaches_ray_nor_the_log(caplog, monkeypatch):
    """An ``--extractor-url`` with a key (user part or query) or an extractor ``api_key`` is refused on Ray (Ray
    records the replicas' arguments); a failing endpoint's log line names the URL without its key; a key in
    ``$KVMEM_EXTRACTOR_API_KEY`` is what the replicas use instead."""
    from kvmem.memory.extract import make_extractor
    from kvmem.server.replicas import refuse_secrets

    for spec in (
        {"base_url": "http://me:sk-SECRET123@127.0.0.1:9/v1", "model": "m"},
        {"base_url": "http://127.0.0.1:9/v1?api_key=sk-SECRET123", "model": "m"},
        {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key": "sk-SECRET123"},
    ):
        with pytest.raises(ValueError, match="KVMEM_EXTRACTOR_API_KEY") as err:
            refuse_secrets({"extractor": spec})
        assert "SECRET123" not in str(err.value)
    refuse_secrets({"extractor": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}, "segments_url": "s3://kv/p"})
    ex = make_extractor({"base_url": "http://me:sk-SECRET123@127.0.0.1:9/v1?key=sk-SECRET456", "model": "m"}, None)
    with caplog.at_level("WARNING", logger="kvmem.extract"):
        assert ex.complete("hi", {"type": "object"}) == ""  # nothing listens on port 9: refused
    assert "extractor endpoint failed" in caplog.text and "SECRET" not in caplog.text
    monkeypatch.setenv("KVMEM_EXTRACTOR_API_KEY", "sk-FROM-ENV")
    assert make_extractor({"base_url": "http://127.0.0.1:9/v1", "model": "m"}, None).api_key == "sk-FROM-ENV"
