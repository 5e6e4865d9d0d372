"""Schemathesis hooks for the gateway's fuzzing (loaded through SCHEMATHESIS_HOOKS).

A JSON schema cannot count tokens: a request that the description allows may still hold
more prompt tokens than the server takes, and OpenAI's answer to that is a 400 with code
`context_length_exceeded`. Schema-valid input must still be accepted for every other
reason, so this check is schemathesis' own positive-data check with that one refusal let
through (the run excludes the stock check).
"""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


def _error_code(response: object) -> str:
    try:
        body = response.json()  # type: ignore[attr-defined]
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("code", "")) if isinstance(error, dict) else ""


@schemathesis.check
def positive_data_accepted_within_the_context(ctx, response, case):
    if response.status_code == 400 and _error_code(response) == "context_length_exceeded":
        return None
    return positive_data_acceptance(ctx, response, case)
