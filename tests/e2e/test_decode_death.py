"""A decode instance SIGKILLed mid-stream: the request never hangs. With another decode
instance alive it completes there (the gateway notices the missing heartbeats and has it
recompute prompt + tokens so far), and the client's stream is exactly the one an
undisturbed run gives: no token repeated, none missing (fp32, greedy)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
from sqlalchemy import select

from shared.db.schema import RequestRecord
from shared.db.session import make_engine, sessionmaker
from tests.conftest import make_database
from tests.e2e.conftest import start_stack, stop_stack
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "SmolLM2-135M-Instruct"
TOKENS = 48
BODY = {
    "model": MODEL,
    "max_tokens": TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
}


@pytest.fixture
def stack(tmp_path, model_dir):
    url, _ = make_database("sqlite", tmp_path)
    s = start_stack(tmp_path, model_dir, url, ["--dtype", "float32", "--decode", "2"])
    yield s
    assert stop_stack(s) == 0


async def row(database_url: str, rid: str, done=lambda r: True) -> RequestRecord:
    engine = make_engine(database_url)

    async def matching() -> RequestRecord | None:
        async with sessionmaker(engine)() as s:
            rec = (
                await s.execute(select(RequestRecord).where(RequestRecord.id == rid))
            ).scalar_one_or_none()
        return rec if rec is not None and done(rec) else None

    try:
        return await until(matching, what=f"a matching record for {rid}")
    finally:
        await engine.dispose()


async def stream(url: str, on_chunk=None) -> dict:
    """Text, finish reason, usage and error of one streamed request; `on_chunk(n, rid)` runs
    after the n-th content chunk."""
    out = {"text": "", "finish": None, "usage": None, "error": None, "done": False}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.post(f"{url}/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 200, await resp.text()
            rid, n = resp.headers["X-Request-Id"], 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                if not line.startswith("data: "):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out["error"] = obj["error"]
                    continue
                out["usage"] = obj.get("usage") or out["usage"]
                for choice in obj.get("choices") or []:
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                    if choice["delta"].get("content"):
                        out["text"] += choice["delta"]["content"]
                        n += 1
                        if on_chunk is not None:
                            await on_chunk(n, rid)
    out["id"] = rid
    return out


async def test_killed_decode_mid_stream_completes_elsewhere_unchanged(stack):
    reference = await stream(stack.url)
    assert reference["done"] and reference["finish"] == "length"
    killed: dict = {}

    async def kill_its_decode(n: int, rid: str) -> None:
        if n != 6:
            return
        rec = await row(stack.database_url, rid, lambda r: bool(r.decode_instance))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.url}/admin/state") as resp:
                state = await resp.json()
        pid = next(i["pid"] for i in state["instances"] if i["instance_id"] == rec.decode_instance)
        os.kill(pid, signal.SIGKILL)
        killed.update(instance=rec.decode_instance, pid=pid, at=time.monotonic())

    got = await asyncio.wait_for(stream(stack.url, kill_its_decode), 120)
    took = time.monotonic() - killed["at"]
    print(
        f"killed {killed['instance']} (pid {killed['pid']}) after 6 chunks; the stream "
        f"ended {took:.1f}s later: finish={got['finish']} error={got['error']}"
    )
    assert got["done"], "the stream must end with [DONE], never hang"
    assert got["error"] is None, got["error"]
    assert got["finish"] == "length"
    assert got["usage"]["completion_tokens"] == TOKENS
    assert got["text"] == reference["text"]  # nothing repeated, nothing lost
    rec = await row(stack.database_url, got["id"], lambda r: r.status != "running")
    assert rec.status == "completed" and rec.completion_tokens == TOKENS
    assert rec.decode_instance != killed["instance"]  # the record says where it finished
