"""The HTTP contract of ``kvmem serve`` without a model: the app over a server that has no service, memory or
engine to reach, so each answer here comes from the request models and the routes' checks alone (a request
that got as far as retrieval would fail). What the OpenAPI document says is what the server enforces."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from fastapi.testclient import TestClient

from kvmem.server.routes import create_app
from kvmem.server.tenants import Tenants
from kvmem.settings import Limits


@pytest.fixture(scope="module")
def client():
    count = NS(inc=lambda: None)
    server = NS(
        limits=Limits(),
        metrics=NS(send_timeouts=count, requests=NS(labels=lambda *a: count)),
        tenants=Tenants({}),
        memory=NS(store=None),  # nothing behind the routes: a request that reaches a write or a read fails
        service=None,
        engine=NS(healthy=lambda: True),
        replica=None,
        start_upkeep=lambda loop: None,
        model_name="m",
    )
    with TestClient(create_app(server), raise_server_exceptions=False) as c:
        yield c


def test_every_200_declares_its_schema_and_the_checks_are_in_the_document(client):
    doc = client.get("/openapi.json").json()
    ops = [(path, op) for path, item in doc["paths"].items() for op in item.values()]
    assert len(ops) >= 25
    for path, op in ops:
        content = op["responses"]["200"]["content"]
        assert any(c.get("schema") for c in content.values()), path
    schemas = doc["components"]["schemas"]
    assert schemas["SearchRequest"]["properties"]["query"]["pattern"] == r"\S"  # a blank query: 400
    user = schemas["AddMemoryRequest"]["properties"]["user_id"]["anyOf"][0]
    assert user["minLength"] == 1 and user["pattern"] == "^[^\\u0000]*$"  # empty: 400; a NUL: 400
    assert schemas["AddMemoryRequest"]["properties"]["app_id"]["type"] == "null"
    assert schemas["UpdateRequest"]["minProperties"] == 1
    stop = schemas["ChatRequest"]["properties"]["stop"]["anyOf"]
    one, many = stop[:2]
    assert (
        one["minLength"] == 1 and "maxLength" not in one and many["maxItems"] == 4 and many["items"]["minLength"] == 1
    )
    ids = {p["name"]: p["schema"] for p in doc["paths"]["/v1/memories"]["get"]["parameters"]}
    assert ids["user_id"]["anyOf"][0]["minLength"] == 1 and ids["limit"]["maximum"] == 10000
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletion"}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ""}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
        ("/v1/memories/search", {"query": " \n", "user_id": "a"}, "query"),
        ("/v1/memories/search", {"query": "x", "user_id": "a", "rerank": True}, "rerank"),
        ("/v1/memories", {"messages": "x", "user_id": ""}, "user_id"),
        ("/v1/memories", {"messages": "x", "app_id": "app"}, "app_id"),
        ("/v1/memories", {"messages": "x", "user_id": "a", "prompt": "p", "custom_instructions": "c"}, "prompt"),
    ],
)
def test_a_request_the_models_refuse_is_a_400_before_any_work(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_request", r.text


def test_an_update_without_fields_and_an_empty_query_id_are_400s(client):
    r = client.put("/v1/memories/abc", json={})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("At least one of text"), r.text
    r = client.get("/v1/memories", params={"agent_id": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "agent_id", r.text


def test_a_method_a_path_does_not_answer_is_a_405_naming_those_it_does(client):
    r = client.request("TRACE", "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET", (r.status_code, r.headers)
    r = client.request("TRACE", "/v1/memories/abc")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "PUT", "DELETE"}, r.headers
