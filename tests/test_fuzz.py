"""Schema fuzzing of ``kvmem serve``'s own OpenAPI document (schemathesis, on loopback): every operation, with
generated valid and invalid bodies, parameters and keys, answers without a 5xx and with a response that keeps
to its own schema and content type, with a status the document lists (every 4xx/5xx with its body). The
transformers engine and the small test model; ``max_tokens`` is capped
by the server's limit, so a generated 4,096-token request is a 400, not minutes of decoding."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from conftest import http_server
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
KEY = "fuzz-key"
EXAMPLES = 8  # per operation and mode (valid, invalid inputs)
SCENARIOS, STEPS = 10, 6  # the stateful phase: sequences of at most STEPS calls along the document's links


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from kvmem.server import KvmemServer, Limits

    if not (model_dir(FAST) / MANIFEST).exists():
        pytest.fail(f"{FAST} is not installed; run: kvmem models install {FAST}")
    srv = KvmemServer.start(
        tmp_path_factory.mktemp("fuzz") / "store",
        model=FAST,
        engine="hf",
        dtype="float32",
        window=1,
        api_keys={KEY: "acme"},
        limits=Limits(max_body_bytes=16 << 10, default_max_tokens=4, max_tokens=4, request_timeout_s=60),
    )
    with http_server(srv) as url:
        r = httpx.post(
            f"{url}/v1/memories",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"messages": "Alice keeps bees.", "user_id": "alice", "infer": False},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        yield url


@pytest.mark.slow
def test_no_operation_answers_a_5xx_or_breaks_its_schema(base):
    """Every operation, valid and invalid inputs, then the stateful phase (sequences along the links
    schemathesis infers: an add's id into get, update, history and delete): 0 server errors, 0 answers off their
    response schema, 0 statuses or content types the document does not list. Failures are counted, not raised
    at the first (no shrinking), and reported together."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    checks = (not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance)
    headers = {"Authorization": f"Bearer {KEY}"}
    found: dict[str, list[str]] = {check.__name__: [] for check in checks}
    sent = {"stateless": 0, "stateful": 0}
    refused: list[str] = []  # valid inputs (by the document) answered 400: a check the document does not carry

    def no_extraction(case) -> None:
        body = case.body if isinstance(case.body, dict) else None
        if body is not None and body.get("infer") is not False and "messages" in body and "user_id" in body:
            body["infer"] = False  # extraction is a model call per add: tested on its own, not fuzzed here

    def check(response, case, phase: str) -> None:
        sent[phase] += 1
        for one in checks:
            try:
                case.validate_response(response, checks=(one,))
            except Exception as exc:  # schemathesis's failure (group): counted per check
                found[one.__name__].append(f"{case.operation.label} {response.status_code}: {str(exc)[:300]}")

    common = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))

    def fuzz_operation(op, mode) -> None:
        @settings(max_examples=EXAMPLES, **common)
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case):
            no_extraction(case)
            response = case.call(base_url=base, headers=headers, timeout=120)
            check(response, case, "stateless")
            if mode == GenerationMode.POSITIVE and response.status_code == 400:
                refused.append(f"{op.label}: {response.json()['error']['message'][:90]}")

        try:
            fuzz()
        except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
            assert mode == GenerationMode.NEGATIVE, op.label

    t0 = time.perf_counter()
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(result.ok(), mode)
    t1 = time.perf_counter()

    class Stateful(schema.as_state_machine()):
        def before_call(self, case):
            no_extraction(case)

        def get_call_kwargs(self, case):
            return {"base_url": base, "headers": headers, "timeout": 120}

        def validate_response(self, response, case, **kwargs):
            check(response, case, "stateful")

    Stateful.run(settings=settings(max_examples=SCENARIOS, stateful_step_count=STEPS, **common))
    figures = {"sent": sent, "valid_400": len(refused), "seconds": (round(t1 - t0), round(time.perf_counter() - t1))}
    print(f"fuzz: {figures}, failures", {k: len(v) for k, v in found.items()})
    print(*sorted(Counter(refused).items(), key=lambda kv: -kv[1])[:30], sep="\n")
    assert all(not v for v in found.values()), (figures, found)
    assert sent["stateless"] >= 300 and sent["stateful"] >= SCENARIOS, figures
    assert time.perf_counter() - t0 < 180, figures
