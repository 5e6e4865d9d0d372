"""Schemathesis hooks for the gateway's fuzzing (loaded through SCHEMATHESIS_HOOKS).

A JSON schema cannot count tokens: a request that the description allows may still hold
more prompt tokens than the server takes, and OpenAI's answer to that is a 400 with code
`context_length_exceeded`. Nor can it compare two fields: text completions take `best_of`
only equal to `n` (no ranking of samples, as in vLLM's V1 engine), which the description
says in words. Schema-valid input must still be accepted for every other reason, so this
check is schemathesis' own positive-data check with those two refusals let through, the
second only for a body whose best_of differs from its n (the run excludes the stock check).
"""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


def _error(response: object) -> dict:
    try:
        body = response.json()  # type: ignore[attr-defined]
    except ValueError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _best_of_differs(body: object) -> bool:
    if not isinstance(body, dict) or body.get("best_of") is None:
        return False
    return body["best_of"] != (body.get("n") if body.get("n") is not None else 1)


@schemathesis.check
def positive_data_accepted_within_the_context(ctx, response, case):
    error = _error(response)
    if response.status_code == 400 and error.get("code") == "context_length_exceeded":
        return None
    if (
        response.status_code == 400
        and error.get("param") == "best_of"
        and _best_of_differs(case.body)
    ):
        return None
    return positive_data_acceptance(ctx, response, case)
