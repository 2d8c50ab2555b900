"""The OpenAPI document says what the server answers: 400 not 422, the error bodies, the
reply bodies and stream events, and /v1/messages' request body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from atom_core.entrypoints.http.openapi import GENERATION_ERRORS, install_openapi
from tests.entrypoints.http.asgi_app import make_app
from tests.entrypoints.http.fake_engine import FakeEngineClient


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    app = make_app(FakeEngineClient())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse({})

    install_openapi(app)
    return app.openapi()


def refs(node: Any) -> list[str]:
    """Every $ref under ``node``."""
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def test_no_422_and_every_ref_resolves(doc):
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    schemas = doc["components"]["schemas"]
    assert {r.removeprefix("#/components/schemas/") for r in refs(doc)} <= schemas.keys()


@pytest.mark.parametrize(
    ("path", "request_schema", "ok", "error"),
    [
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse",
         "ErrorResponse"),
        ("/v1/completions", "CompletionRequest", "CompletionResponse", "ErrorResponse"),
        ("/v1/messages", "MessagesRequest", "MessageOut", "ErrorOut"),
    ],
)
def test_generation_routes(doc, path, request_schema, ok, error):
    operation = doc["paths"][path]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{request_schema}"}
    responses = operation["responses"]
    assert sorted(responses) == sorted(["200", *map(str, GENERATION_ERRORS)])
    assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{ok}")
    for status in GENERATION_ERRORS:
        schema = responses[str(status)]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{error}"}
    event = responses["200"]["content"]["text/event-stream"]["schema"]
    assert event["required"] == ["data"]
    # A stream that fails ends on an error event.
    assert f"#/components/schemas/{error}" in refs(event)


def test_openai_streams_end_on_done_and_anthropic_ones_do_not(doc):
    def data(path: str) -> dict[str, Any]:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        return content["text/event-stream"]["schema"]["properties"]["data"]

    assert {"const": "[DONE]"} in data("/v1/chat/completions")["anyOf"]
    assert data("/v1/messages")["contentMediaType"] == "application/json"
    assert "anyOf" not in data("/v1/messages")


def test_request_schemas_state_the_ranges_the_server_holds(doc):
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    # Exact bounds: FastAPI's own document wrote 2**63 - 1 as the float 2.0**63.
    assert chat["seed"]["anyOf"][0]["maximum"] == 2**63 - 1
    assert chat["temperature"]["minimum"] == 0 and chat["top_p"]["exclusiveMinimum"] == 0
    assert chat["tools"]["anyOf"][0]["items"] == {"$ref": "#/components/schemas/ChatTool"}
    tool = schemas["ToolDefinition"]["properties"]["input_schema"]
    assert "input_schema" in schemas["ToolDefinition"]["required"]
    assert tool["properties"]["type"] == {"const": "object"}
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string"} in prompt["anyOf"]  # a single prompt, as well as a batch


def test_other_routes(doc):
    paths = doc["paths"]
    models = paths["/v1/models"]["get"]["responses"]
    assert models["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelList")
    assert set(models) == {"200", "401", "503"}
    card = doc["components"]["schemas"]["ModelCard"]
    assert card["properties"]["tokenizer"] == {"$ref": "#/components/schemas/TokenizerInfo"}
    assert {"root", "max_model_len", "tokenizer"} <= set(card["required"])
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


@pytest.mark.parametrize(
    ("path", "bodies", "ok", "error"),
    [
        ("/tokenize", ["TokenizeCompletionRequest", "TokenizeChatRequest"], "TokenizeResponse",
         "ErrorResponse"),
        ("/detokenize", ["DetokenizeRequest"], "DetokenizeResponse", "ErrorResponse"),
        ("/v1/messages/count_tokens", ["CountTokensRequest"], "MessageTokensCount", "ErrorOut"),
    ],
)
def test_tokenizer_routes(doc, path, bodies, ok, error):
    operation = doc["paths"][path]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    refs_ = [b["$ref"] for b in body.get("anyOf", [body])]
    assert refs_ == [f"#/components/schemas/{name}" for name in bodies]
    responses = operation["responses"]
    assert sorted(responses) == ["200", "400", "401", "404", "413"]  # no queue, no engine
    assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{ok}")
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{error}")
    assert "text/event-stream" not in responses["200"]["content"]


def test_the_document_is_built_once():
    app = FastAPI()
    install_openapi(app)
    assert app.openapi() is app.openapi()
