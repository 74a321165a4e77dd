"""The server's HTTP API fuzzed with Schemathesis: a tiny random model served on 127.0.0.1, every operation
of the API's OpenAPI schema given schema-valid and schema-violating requests (a bounded, derandomized number
per operation): no 5xx, every answer within the client's timeout, and the server healthy afterwards.

The server publishes no OpenAPI document (its app sets openapi_url=None and reads request bodies by hand,
protocol.parse), so the schema is written here: the operations and the OpenAI request fields it reads.
"""
from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from test_serving import serving, tiny  # noqa: E402, F401  (the fixture)

CASES = 100  # examples per operation and mode (schema-valid, schema-violating): about 400 requests, 20 s

_ANSWERS = {str(code): {"description": "answer"} for code in (200, 400, 404, 405, 413, 422, 429, 503)}
_SAMPLING = {  # the valid ranges (the tiny model: 128 tokens, a 512-token context); negative cases break them
    "model": {"type": "string", "maxLength": 20},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 24},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 100},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2 ** 31},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 8},
                       {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "additionalProperties": False},
    "n": {"type": "integer", "enum": [1]},
    "user": {"type": "string", "maxLength": 20},
    # a request's own stack (serving/stacks.py): methods, levels, and strings that are neither
    "stack": {"oneOf": [{"type": "string", "enum": ["ar", "ngram", "triforce", "sequoia", "ngram,retrieval:48,full",
                                                    "streaming:40,full", "h2o:48,full", "kv4,full", "head,full"]},
                        {"type": "string", "maxLength": 40}]},
    "gammas": {"oneOf": [{"type": "string", "pattern": "^[1-6](,[1-6]){0,2}$"}, {"type": "integer", "minimum": 1,
                                                                                "maximum": 6}]},
}
SCHEMA = {
    "openapi": "3.0.3",
    "info": {"title": "triforce serve", "version": "1"},
    "paths": {
        "/v1/completions": {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["prompt"], "additionalProperties": False,
                "properties": {**_SAMPLING, "prompt": {"oneOf": [
                    {"type": "string", "minLength": 1, "maxLength": 300},
                    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 127}, "minItems": 1,
                     "maxItems": 300}]}}}}}},
            "responses": _ANSWERS}},
        "/v1/chat/completions": {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["messages"], "additionalProperties": False,
                "properties": {**_SAMPLING, "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 24},
                               "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                                   "type": "object", "required": ["role", "content"], "additionalProperties": False,
                                   "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                                                  "content": {"type": "string", "maxLength": 100}}}}}}}}},
            "responses": _ANSWERS}},
        "/v1/models": {"get": {"responses": _ANSWERS}},
        "/health": {"get": {"responses": _ANSWERS}},
        "/metrics": {"get": {"responses": _ANSWERS}},
        "/": {"get": {"responses": _ANSWERS}},
        "/page/info": {"get": {"responses": _ANSWERS}},
    },
}


@pytest.mark.slow  # about 400 requests
def test_fuzzed_requests_never_get_a_server_error(tiny):  # noqa: F811
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(SCHEMA)
    from collections import Counter

    ran, errors, codes = 0, [], Counter()
    with serving(tiny) as (url, _):
        for result in schema.get_all_operations():
            operation = result.ok()
            # schema-violating requests where there is a body to break (a GET here takes no parameter)
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
            for mode in modes:
                @settings(max_examples=CASES, suppress_health_check=list(HealthCheck))
                @given(operation.as_strategy(generation_mode=mode))
                def call(case):
                    nonlocal ran
                    ran += 1
                    response = case.call(base_url=url, timeout=60)
                    codes[response.status_code] += 1
                    if response.status_code >= 500:
                        errors.append((operation.label, mode.name, case.body, response.status_code, response.text[:300]))
                    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])

                call()
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 200, health.text
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200 and done.json()["choices"][0]["text"], done.text
    print(f"\nSchemathesis: {ran} requests, answers by status {dict(sorted(codes.items()))}, {len(errors)} server errors")
    assert codes[200] > 0 and codes[400] > 0  # both generations and refusals were reached
    assert not errors, errors
