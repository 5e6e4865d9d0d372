"""The OpenAPI description: every route, valid OpenAPI 3.1, request schemas from pydantic."""

from __future__ import annotations

import types

import schemathesis

from services.gateway.app import make_app
from services.gateway.args import GatewaySettings
from services.gateway.context import GatewayContext
from services.gateway.openapi import build_spec, described
from services.gateway.protocol import ChatCompletionRequest


def spec_for(settings: GatewaySettings) -> tuple[dict, list[tuple[str, str]]]:
    # No bus, SQL or model: building routes and the description touches none of them.
    ctx = GatewayContext(settings, None, None, types.SimpleNamespace(model_name="tiny"), "gw-test")
    app = make_app(ctx, 1 << 20)
    routes = [(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"]
    return build_spec(app, "tiny", settings), routes


def test_every_route_is_described_and_listed():
    spec, routes = spec_for(GatewaySettings())
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/openapi.json") in routes
    for method, path in routes:
        assert described(method, path), f"{method} {path} has no description in openapi.py"
        assert method.lower() in spec["paths"][path]


def test_the_description_is_valid_openapi_3_1():
    for settings in (GatewaySettings(), GatewaySettings(require_api_key=True)):
        spec, _ = spec_for(settings)
        schemathesis.openapi.from_dict(spec).validate()  # the official 3.1 meta-schema


def test_request_schema_is_pydantics_with_this_servers_limits():
    spec, _ = spec_for(GatewaySettings(max_messages=7, max_output_tokens=64, default_max_tokens=32))
    body = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert set(body["properties"]) == set(ChatCompletionRequest.model_fields)
    assert body["required"] == ["model", "messages"]
    assert body["properties"]["model"]["enum"] == ["tiny"]
    assert body["properties"]["messages"]["maxItems"] == 7
    ints = [b for b in body["properties"]["max_tokens"]["anyOf"] if b.get("type") == "integer"]
    assert ints == [{"type": "integer", "minimum": 1, "maximum": 64}]
    op = spec["paths"]["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest"
    )
    assert {"400", "404", "413", "429"} <= set(op["responses"])
    assert "text/event-stream" in op["responses"]["200"]["content"]


def test_errors_are_openai_style_and_auth_shows_only_when_keys_are_on():
    open_spec, _ = spec_for(GatewaySettings())
    keyed, _ = spec_for(GatewaySettings(require_api_key=True))
    assert "securitySchemes" not in open_spec["components"]
    assert keyed["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    for path, ops in keyed["paths"].items():
        for method, op in ops.items():
            public = path in ("/health", "/openapi.json", "/metrics", "/version")
            assert ("security" in op) != public, (method, path)
            assert ("401" in op["responses"]) != public
            assert ("403" in open_spec["paths"][path][method]["responses"]) is False
            for code, resp in op["responses"].items():
                if not code.startswith("2") and path != "/health":  # 200, or 202 (accepted)
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse")
    chat = keyed["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "Retry-After" in chat["429"]["headers"]
    assert "429" not in keyed["paths"]["/admin/kv"]["get"]["responses"]  # admin: no limit
