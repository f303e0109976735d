"""Schema fuzzing of ``kvmem serve``'s own OpenAPI document (schemathesis, on loopback): every operation, with
generated valid and invalid bodies, parameters and keys, answers without a 5xx and with a response that keeps
to its own schema and content type, with a status the document lists (every 4xx/5xx with its body). The
transformers engine and the small test model; ``max_tokens`` is capped
by the server's limit, so a generated 4,096-token request is a 400, not minutes of decoding."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import http_server
from kvmem.models import MANIFEST, model_dir

FAST = "smollm2-135m-instruct"
KEY = "fuzz-key"
EXAMPLES = 25  # per operation: about 25 s on 2 cores (AVX2 kind)


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

    def fuzz_operation(op, mode) -> int:
        """Run ``EXAMPLES`` generated cases of one operation (valid, or invalid, inputs); returns how many."""
        sent = [0]

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case):
            body = case.body if isinstance(case.body, dict) else None
            if body is not None and body.get("infer") is not False and "messages" in body and "user_id" in body:
                body["infer"] = False  # extraction is a model call per add: tested on its own, not fuzzed here
            response = case.call(base_url=base, headers=headers, timeout=120)
            case.validate_response(response, checks=checks)
            sent[0] += 1

        try:
            fuzz()
        except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
            assert mode == GenerationMode.NEGATIVE, op.label
        return sent[0]

    t0 = time.perf_counter()
    ran = {
        (result.ok().label, mode.value): fuzz_operation(result.ok(), mode)
        for result in schema.get_all_operations()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    }
    valid = {op: n for (op, mode), n in ran.items() if mode == "positive"}
    assert len(valid) >= 10 and all(n >= 1 for n in valid.values()), ran
    assert time.perf_counter() - t0 < 180, ran
