"""API keys at the door: who calls (the tenant), may they (the route), how often (the rate).

Installed only when keys are enabled. /health and /openapi.json stay open (probes, and
the description of how to authenticate); /v1/* takes tenant keys, /admin/* admin keys.
Runs before the body is read, so a caller without a key cannot make the gateway read
or tokenize anything. Secrets never reach a log line or an error body.
"""

from __future__ import annotations

import logging
from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from sqlalchemy.ext.asyncio import AsyncEngine

from services.gateway.args import GatewaySettings
from services.gateway.keys import ApiKey, KeyStore, hash_key, parse_key_specs
from services.gateway.ratelimit import KeyLimiter
from shared import errors

log = logging.getLogger(__name__)

Area = Literal["public", "api", "admin"]


class InvalidApiKey(errors.HalfmoonError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(errors.HalfmoonError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


# Outside /v1 but an API all the same: they run the tokenizer on the caller's text.
API_PATHS = frozenset({"/tokenize", "/detokenize"})


def area_of(path: str) -> Area:
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    if path == "/v1" or path.startswith("/v1/") or path in API_PATHS:
        return "api"
    return "public"


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Auth:
    def __init__(self, store: KeyStore, limiter: KeyLimiter) -> None:
        self.store = store
        self.limiter = limiter

    @classmethod
    def from_settings(cls, settings: GatewaySettings, engine: AsyncEngine | None) -> Auth:
        static = parse_key_specs(settings.api_keys)
        admin = settings.admin_secret()
        if admin:
            static[hash_key(admin)] = ApiKey(id="env-admin", tenant="admin", admin=True)
        return cls(
            KeyStore(engine, static, settings.key_cache_s), KeyLimiter(settings.default_rate_limit)
        )

    async def authenticate(self, request: web.Request) -> ApiKey | None:
        """The caller's key for this route (None on public routes), or a 401/403/429."""
        area = area_of(request.path)
        if area == "public":
            return None
        token = bearer_token(request)
        if token is None:
            raise InvalidApiKey(
                "You didn't provide an API key. Send it in the Authorization "
                "header as 'Bearer YOUR_KEY'."
            )
        key = await self._lookup(token)
        if key is None:
            raise InvalidApiKey("Incorrect API key provided.")
        if key.admin != (area == "admin"):
            need = "an admin key" if area == "admin" else "a tenant key, not an admin key"
            raise PermissionDenied(f"{request.path} needs {need} (key {key.id}).")
        if not key.admin:
            wait = await self.limiter.hit(key.id, key.rate_limit)
            if wait is not None:
                raise errors.Rejected(
                    f"Rate limit reached for key {key.id}; retry in {max(1, round(wait))}s.",
                    code="rate_limit_exceeded",
                    retry_after_s=wait,
                )
        return key

    async def _lookup(self, token: str) -> ApiKey | None:
        try:
            return await self.store.lookup(token)
        except Exception as exc:  # noqa: BLE001 - SQL down: refuse, and say why without secrets
            log.warning("API key lookup failed: %s", type(exc).__name__)
            raise errors.Unavailable("the API key store is unavailable; try again") from None

    def middleware(self) -> Middleware:
        @web.middleware
        async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            key = await self.authenticate(request)
            if key is not None:
                request["tenant"] = key.tenant
                request["key_id"] = key.id
            return await handler(request)

        return auth_middleware
