"""Broken and hostile messages on every subject the services serve, against a real stack.

Anyone who can reach the bus can send them: a buggy peer, an older or newer version in a
rolling upgrade, a stranger. Generated (hypothesis, seeded) from a valid message for each
subject: random bytes, a truncated message, JSON of the wrong shape, a field set to a
value out of its range or of the wrong type, a field missing, another schema version.

Every request/reply handler must answer in time, with its reply type or a typed error;
every other handler drops what it cannot use. Afterwards no service has crashed (the
same processes run; `halfmoon up` would have restarted a dead one), none logged a
traceback, the engines hold nothing once the fuzzer's requests are cancelled (no hung
request), and a real request gives the same greedy output as before (no corrupted state).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from shared import errors, subjects
from shared.bus import decode_reply
from shared.handoff_messages import KVHeld, KVHold
from shared.kv_messages import KVMatchReply, KVMatchRequest, KVReplicate
from shared.messages import (
    Ack,
    CancelRequest,
    DecodeJob,
    GenerateRequest,
    InstanceInfo,
    KVChunk,
    KVEvent,
    KVEventKind,
    KVExportReply,
    KVExportRequest,
    KVHandle,
    Message,
    Placement,
    PrefillJob,
    Role,
    SamplingParams,
    StageClose,
    StageHop,
    StageJob,
    StageOpened,
    StageRef,
    TokenEvent,
)
from tests.e2e.conftest import children_of, start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
# Bounded so the run takes well under a minute; HALFMOON_FUZZ_SEED explores more.
MAX_EXAMPLES = 400
SEED = int(os.environ.get("HALFMOON_FUZZ_SEED", "20261203"))
# A handler answers at once (a job is queued, not run, before the reply); this bound is
# only for a machine three times slower with the stack busy.
REPLY_S = 30.0

HOSTILE = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    1e308,
    -1e308,
    1e-320,
    "",
    "x" * 100_000,
    "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
    [],
    [-1],
    [2**40],
    ["a"],
    {},
    {"1": "x"},
    {"-1": 1e308},
]


def chat_body(text: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
    }


def generate(rid: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=MODEL,
        prompt_token_ids=[1, 504, 3060, 30],
        sampling=SamplingParams(temperature=0.0, max_tokens=2),
        arrival_time=time.time(),
    )


def templates(prefill: str, decode: str, rid: str) -> dict[str, tuple[Message, type | None]]:
    """subject -> (a valid message for it, its reply type or None: no reply)."""
    req = generate(rid)
    handle = KVHandle(transfer_id="t" * 32, host="127.0.0.1", port=1, nbytes=64, num_tokens=4)
    return {
        subjects.CONDUCTOR_SCHEDULE: (req, Placement),
        subjects.KV_MATCH: (KVMatchRequest(block_hashes=[1, 2, 3]), KVMatchReply),
        subjects.prefill_submit(prefill): (PrefillJob(request=req, decode_id=decode), Ack),
        subjects.decode_submit(decode): (
            DecodeJob(request=req, prefill_id=prefill, kv=None, output_token_ids=[30]),
            Ack,
        ),
        subjects.decode_hold(decode): (
            KVHold(request=req, prefill_id=prefill, num_kv_tokens=4, whole=True),
            KVHeld,
        ),
        subjects.decode_stream(decode): (
            KVChunk(request_id=rid, prefill_id=prefill, kv=handle),
            Ack,
        ),
        subjects.kv_export(prefill): (KVExportRequest(block_hashes=[1, 2]), KVExportReply),
        # Stage 0 of a group whose stage 1 is nowhere: its first hop finds nobody.
        subjects.prefill_stage(prefill): (
            StageJob(
                request=req,
                stages=[
                    StageRef(instance_id=prefill, first_layer=0, end_layer=15),
                    StageRef(instance_id="fuzz-phantom", first_layer=15, end_layer=30),
                ],
                index=0,
                decode_id=decode,
            ),
            StageOpened,
        ),
        subjects.prefill_hop(prefill): (StageHop(request_id=rid, hidden=handle), Ack),
        # A hot prefix's copy from an instance that is nowhere: the pull fails and logs.
        subjects.prefill_replicate(prefill): (
            KVReplicate(source="fuzz-phantom", block_hashes=[7], token_ids=[30] * 16),
            None,
        ),
        subjects.prefill_stage_close(prefill): (StageClose(request_id=rid), Ack),
        subjects.CANCEL: (CancelRequest(request_id=rid), None),
        subjects.KV_EVENTS: (
            KVEvent(kind=KVEventKind.STORED, instance_id=prefill, block_hashes=[7, 8]),
            None,
        ),
        subjects.heartbeat("decode", "fuzz-phantom"): (
            InstanceInfo(instance_id="fuzz-phantom", role=Role.DECODE, sent_at=time.time()),
            None,
        ),
        subjects.tokens(rid): (TokenEvent(request_id=rid, index=0, token_ids=[30]), None),
    }


def paths(doc: Any, at: tuple = ()) -> list[tuple]:
    """Every key path in a JSON document (dict keys and list indexes)."""
    out = [at] if at else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, (*at, i))
    return out


def set_at(doc: Any, path: tuple, value: Any, delete: bool = False) -> None:
    for key in path[:-1]:
        doc = doc[key]
    if delete and isinstance(doc, dict):
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


@st.composite
def hostile(draw: st.DrawFn, subject_names: list[str], docs: dict[str, dict]) -> tuple:
    """(subject, bytes): one broken or hostile message."""
    subject = draw(st.sampled_from(subject_names))
    doc = copy.deepcopy(docs[subject])
    kind = draw(
        st.sampled_from(["bytes", "truncated", "shape", "field", "field", "missing", "version"])
    )
    if kind == "bytes":
        return subject, draw(st.binary(max_size=512))
    if kind == "shape":  # JSON, but not this message
        value = draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids),
                max_leaves=10,
            )
        )
        return subject, json.dumps(value).encode()
    if kind == "truncated":
        data = json.dumps(doc).encode()
        return subject, data[: draw(st.integers(0, len(data) - 1))]
    if kind == "version":
        doc["v"] = draw(st.sampled_from([0, 2, 99, -1, "1", None, 1.5]))
    else:
        path = draw(st.sampled_from(paths(doc)))
        set_at(doc, path, draw(st.sampled_from(HOSTILE)), delete=kind == "missing")
    return subject, json.dumps(doc).encode()


def rids_in(data: bytes) -> set[str]:
    """Request ids a message may have started work under (to cancel them afterwards)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return set()
    found: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            rid = x.get("request_id")
            if isinstance(rid, str):
                found.add(rid)
            for v in x.values():
                walk(v)

    walk(doc)
    return found


@pytest.fixture(scope="module")
def fuzzed_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    """A stack of its own: the fuzzer's phantom instances must not reach other tests."""
    tmp = tmp_path_factory.mktemp("bus-fuzz")
    db = f"sqlite+aiosqlite:///{tmp / 'halfmoon.db'}"
    s = start_stack(tmp, model_dir, db, ["--dtype", "float32"])
    yield s
    assert stop_stack(s) == 0, s.log()[-3000:]


def state(url: str) -> dict:
    return httpx.get(f"{url}/admin/state", timeout=30).json()


def chat(url: str, text: str) -> str:
    resp = httpx.post(f"{url}/v1/chat/completions", json=chat_body(text), timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


async def send(nc: nats.NATS, subject: str, data: bytes, reply_type: type | None) -> str:
    """What became of one message: its reply's kind, or 'published'."""
    if reply_type is None:
        await nc.publish(subject, data)
        await nc.flush()
        return "published"
    try:
        reply = await nc.request(subject, data, timeout=REPLY_S)
    except nats.errors.TimeoutError:
        raise AssertionError(f"no reply on {subject} in {REPLY_S:.0f}s to {data[:300]!r}") from None
    try:
        decode_reply(reply.data, reply_type)
    except errors.HalfmoonError as exc:
        assert exc.code and exc.message, reply.data
        return f"error {exc.code}"
    return "ok"


def test_no_message_on_the_bus_crashes_hangs_or_corrupts_a_service(fuzzed_stack):
    url = fuzzed_stack.url
    nats_url = re.search(r"NATS\s+(nats://\S+)", fuzzed_stack.log()).group(1)  # type: ignore[union-attr]
    real = {i["role"]: i["instance_id"] for i in state(url)["instances"]}
    pids = sorted(children_of(fuzzed_stack.proc.pid))
    before = chat(url, "Name three colours.")
    log_from = len(fuzzed_stack.lines)

    table = templates(real["prefill"], real["decode"], "fuzz-req")
    docs = {subject: json.loads(msg.encode()) for subject, (msg, _) in table.items()}
    outcomes: dict[str, int] = {}
    started: set[str] = {"fuzz-req"}

    with asyncio.Runner() as runner:
        nc = runner.run(nats.connect(nats_url))

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @seed(SEED)
        @given(case=hostile(list(table), docs))
        def one(case: tuple[str, bytes]) -> None:
            subject, data = case
            started.update(rids_in(data))
            outcome = runner.run(send(nc, subject, data, table[subject][1]))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        one()
        for rid in started:  # whatever the fuzzer set running, a peer may cancel
            if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", rid):  # (no other id starts anything)
                runner.run(nc.publish(subjects.CANCEL, CancelRequest(request_id=rid).encode()))
        runner.run(nc.drain())
    print("bus fuzz outcomes:", dict(sorted(outcomes.items())))
    assert sum(outcomes.values()) >= MAX_EXAMPLES // 2

    last: list[dict] = []

    async def settled() -> bool:  # the engines hold nothing (phantoms are listed a while)
        last[:] = [i for i in state(url)["instances"] if i["instance_id"] in real.values()]
        return len(last) == len(real) and all(
            i["running"] == 0 and i["queue_depth"] == 0 and i["kv_blocks_leased"] == 0 for i in last
        )

    try:
        asyncio.run(until(settled, timeout_s=180, what="the engines idle"))
    except AssertionError as exc:
        held = [
            {k: i[k] for k in ("instance_id", "role", "running", "queue_depth", "kv_blocks_leased")}
            for i in last
        ]
        raise AssertionError(f"{exc}: {held}") from None
    assert sorted(children_of(fuzzed_stack.proc.pid)) == pids, "a service was restarted"
    assert chat(url, "Name three colours.") == before
    during = "".join(fuzzed_stack.lines[log_from:])
    assert "Traceback" not in during, during[-5000:]
