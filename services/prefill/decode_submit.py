"""Handing a prefilled request to decode: submit the job to the decode instance the
conductor named, and when that one refuses it (switching role, full, or gone) ask the
conductor for another and try that, a few times."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS

from shared import bus, errors, subjects
from shared.messages import Ack, DecodeJob, Placement
from shared.role_messages import Redecode

log = logging.getLogger(__name__)

TRIES = 3  # decode instances asked before the request fails


async def submit_decode(nc: NATS, job: DecodeJob, decode_id: str) -> errors.HalfmoonError | None:
    """None once a decode instance took the job, else why none did."""
    tried: list[str] = []
    while True:
        try:
            await bus.request(nc, subjects.decode_submit(decode_id), job, Ack, timeout_s=5.0)
            return None
        except errors.Timeout as exc:  # it may have taken it: a second copy would run
            return _refused(decode_id, exc)
        except errors.HalfmoonError as exc:
            tried.append(decode_id)
            log.info(
                "request %s: decode %s refused the handoff (%s)",
                job.request.request_id,
                decode_id,
                exc.message,
            )
            if len(tried) >= TRIES:
                return _refused(decode_id, exc)
            decode_id = await _another_decode(nc, job, tried)
            if not decode_id:
                return _refused(tried[-1], exc)
            # A job with held_blocks names KV the new one does not hold: it will
            # recompute the prompt (slower, never wrong).


async def _another_decode(nc: NATS, job: DecodeJob, tried: list[str]) -> str:
    """The conductor's choice of a decode instance not in `tried` ("" if none)."""
    try:
        placed = await bus.request(
            nc,
            subjects.CONDUCTOR_REDECODE,
            Redecode(request=job.request, exclude=tried),
            Placement,
            timeout_s=5.0,
        )
    except errors.HalfmoonError as exc:
        log.warning("request %s: no other decode instance (%s)", job.request.request_id, exc)
        return ""
    return placed.decode_id


def _refused(decode_id: str, exc: errors.HalfmoonError) -> errors.HalfmoonError:
    return errors.HalfmoonError(
        f"decode {decode_id} did not take the request: {exc.message}", code=exc.code
    )
