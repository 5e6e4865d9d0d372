"""Typed errors with a code, an HTTP status and an OpenAI-style body.

Services raise these; the gateway turns them into responses and NATS handlers into
ErrorReply messages, so a client never sees a traceback.
"""

from __future__ import annotations

from typing import Any


class HalfmoonError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s

    def with_status(self, status: int) -> HalfmoonError:
        self.status = status
        return self

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(HalfmoonError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFound(HalfmoonError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(HalfmoonError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Rejected(HalfmoonError):
    """Refused before compute is spent (overload, SLO cannot be met)."""

    status = 429
    type = "rate_limit_error"
    code = "rejected"


class Unavailable(HalfmoonError):
    """No instance can take the request right now (none alive, bus down)."""

    status = 503
    type = "server_error"
    code = "unavailable"


class KVLoadFailed(Unavailable):
    """A request's KV could not be loaded (pulled, handed off or read from disk) and the
    deployment's policy is to fail rather than recompute it (shared/kv_load.py)."""

    code = "kv_load_failed"


class UpstreamFailed(HalfmoonError):
    """A worker failed the request after it was accepted."""

    status = 500
    type = "server_error"
    code = "upstream_failed"


class Conflict(HalfmoonError):
    """The request is well formed, but the cluster's state forbids it now (a role switch
    that would leave a role empty, of an instance switching already)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class Timeout(HalfmoonError):
    status = 504
    type = "server_error"
    code = "timeout"


_BY_CODE: dict[str, type[HalfmoonError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        ModelNotFound,
        PayloadTooLarge,
        Rejected,
        Unavailable,
        KVLoadFailed,
        UpstreamFailed,
        Conflict,
        Timeout,
    )
}


_BY_STATUS: dict[int, type[HalfmoonError]] = {
    cls.status: cls
    for cls in (
        InvalidRequest,
        ModelNotFound,
        PayloadTooLarge,
        Rejected,
        Unavailable,
        Conflict,
        Timeout,
    )
}


def from_code(
    code: str, message: str, retry_after_s: float | None = None, status: int | None = None
) -> HalfmoonError:
    """Rebuild a typed error from an ErrorReply that crossed the bus: by its code, else by
    its HTTP status (a 429 with a specific code is still a Rejected)."""
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status or 0, UpstreamFailed)
    return cls(message, code=code, retry_after_s=retry_after_s)
