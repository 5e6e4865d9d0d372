"""The fleet baseline: its routes (pure), its router in front of two small HTTP servers
(the router's neighbours), and, where llama.cpp is built, a real fleet of llama-servers."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from services.tools.bench import llama_cpp
from services.tools.bench.client import stream_chat
from services.tools.bench.fleet import FleetConfig, local_fleet, shares
from services.tools.bench.fleet.router import Router
from services.tools.bench.fleet.routing import (
    BLOCK_CHARS,
    PrefixAffinity,
    RoundRobin,
    make_route,
    prefix_blocks,
    prompt_text,
)
from services.tools.bench.fleet.verdict import fleet_comparison
from services.tools.bench.placement import free_port

DOC = "".join(f"word{i} " for i in range(200))  # about 1,500 characters: 23 blocks


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


# -- routes ------------------------------------------------------------------------------
def test_blocks_chain_so_equal_hashes_mean_equal_prefixes():
    a, b = prefix_blocks(DOC), prefix_blocks(DOC + "and more text past the end")
    assert len(a) == len(DOC) // BLOCK_CHARS and b[: len(a)] == a
    other = prefix_blocks("X" + DOC[1:])  # one character differs in the first block
    assert not set(other) & set(a)


def test_round_robin_ignores_the_prompt():
    route = RoundRobin(3)
    assert [route.pick(DOC, [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_prefix_affinity_follows_the_conversation_and_spreads_the_rest(seed):
    route = PrefixAffinity(2, seed=seed)
    first = route.pick(prompt_text(chat(DOC)), [0, 0])  # a tie: drawn
    load = [0, 0]
    load[first] = 1
    # The same document again, its server busier: 3 x 1.0 (prefix) beats 2 x 1.0 (queue).
    assert route.pick(prompt_text(chat(DOC + " a question")), load) == first
    # Another document goes where the queue is shorter.
    assert route.pick(prompt_text(chat("another " * 100)), load) == 1 - first


def test_ties_are_drawn_so_an_idle_fleet_spreads_fresh_prompts():
    route = PrefixAffinity(2, seed=1)
    picks = {route.pick(f"prompt {i} " * 20, [0, 0]) for i in range(20)}
    assert picks == {0, 1}


def test_prefix_affinity_forgets_the_least_recently_sent_blocks():
    route = PrefixAffinity(1, capacity=10)
    blocks = prefix_blocks(DOC)
    route.pick(DOC, [0])
    assert route.matched(0, blocks) == 0  # the leading blocks went first: no prefix left
    assert route.matched(0, blocks[-10:]) == 10


def test_prompt_text_reads_chat_parts_and_completion_prompts():
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert prompt_text({"messages": [parts]}) == "<user>ab"
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text(["not", "a", "body"]) == prompt_text({"prompt": [1, 2]}) == ""
    with pytest.raises(ValueError, match="round_robin, prefix"):
        make_route("random", 2)


def test_fleet_flags_and_core_shares():
    cfg = FleetConfig.parse("pa=--servers 2 --route prefix --precision int8 --parallel 8")
    assert (cfg.servers, cfg.route, cfg.precision, cfg.parallel) == (2, "prefix", "int8", 8)
    assert "behind a prefix router" in cfg.describe()
    for bad in ("noflags", "x=--route random", "x=--servers 0"):
        with pytest.raises(ValueError):
            FleetConfig.parse(bad)
    assert shares([4, 5, 6, 7], 2) == [(4, 5), (6, 7)]
    with pytest.raises(ValueError, match="evenly"):
        shares([0, 1, 2], 2)


def test_the_verdict_is_goodput_over_the_better_fleet():
    def run(name, goodput, hit, fleet=False):
        return {
            "name": name,
            "fleet": fleet,
            "summary": {"goodput_rps": goodput, "cache_hit_ratio": hit},
        }

    runs = [run("halfmoon", 1.4, 0.5), run("rr", 0.8, 0.1, True), run("pa", 1.0, 0.4, True)]
    (v,) = fleet_comparison(runs)
    assert v["ratio"] == pytest.approx(1.4) and v["met"]
    assert "halfmoon / pa" in v["text"] and "rr 10%" in v["text"] and "halfmoon 50%" in v["text"]
    (v,) = fleet_comparison([run("halfmoon", 1.0, 0.5), run("pa", 1.0, 0.4, True)])
    assert not v["met"]
    assert fleet_comparison(runs[:1]) == []


# -- the router, in front of two small servers ---------------------------------------------
async def _backend(name: str, seen: list[str], gate: asyncio.Event) -> web.AppRunner:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(name)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await gate.wait()  # held open: the router counts it in flight meanwhile
        for word in (name, body["messages"][-1]["content"][:5]):
            delta = {"choices": [{"delta": {"content": word}}]}
            await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": name}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


async def _serve(runner: web.AppRunner) -> str:
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}"


async def test_the_router_streams_each_answer_from_the_server_it_picked():
    seen: list[str] = []
    gate = asyncio.Event()
    runners = [await _backend(n, seen, gate) for n in ("a", "b")]
    urls = [await _serve(r) for r in runners]
    router = Router(urls, PrefixAffinity(2, seed=0))
    front = web.AppRunner(router.app())
    await front.setup()
    url = await _serve(front)
    try:
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(stream_chat(http, url, chat(DOC)))
            while sum(router.in_flight) != 1:
                await asyncio.sleep(0.01)
            i = router.in_flight.index(1)
            second = asyncio.create_task(stream_chat(http, url, chat("other " * 50)))
            while sum(router.in_flight) != 2:
                await asyncio.sleep(0.01)
            assert router.in_flight == [1, 1]  # the new prompt went to the idle server
            gate.set()
            a, b = await first, await second
            names = "ab"
            assert (a.text, b.text) == (f"{names[i]}word0", f"{names[1 - i]}other")
            assert a.ok and b.ok
            again = await stream_chat(http, url, chat(DOC + " more"))
            assert again.text == f"{names[i]}word0"  # the conversation stays with its prefix
            async with http.get(f"{url}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "a"
            async with http.get(f"{url}/health") as resp:
                health = await resp.json()
        assert health["in_flight"] == [0, 0] and health["sent"][i] == 2
        assert seen == [names[i], names[1 - i], names[i]]
    finally:
        for r in [front, *runners]:
            await r.cleanup()


async def test_a_server_that_is_gone_is_a_502_with_an_openai_error():
    router = Router([f"http://127.0.0.1:{free_port()}"], make_route("round_robin", 1))
    front = web.AppRunner(router.app())
    await front.setup()
    url = await _serve(front)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json=chat("hi")) as resp:
                assert resp.status == 502
                assert "fleet server 0 failed" in (await resp.json())["error"]["message"]
        assert router.in_flight == [0]
    finally:
        await front.cleanup()


# -- a real fleet ----------------------------------------------------------------------------
@pytest.mark.model
async def test_a_real_fleet_keeps_a_conversation_on_the_server_that_cached_it(
    model_dir: Path, tmp_path: Path
):
    """Two llama-servers (f32, a core share each) behind the prefix router:
    every answer streams through it, and a follow-up of a long prompt goes to the server
    that holds the prompt, which says so in its usage (cached tokens)."""
    root = llama_cpp.home()
    gguf = llama_cpp.gguf_path(root, model_dir.name, "f32")
    if llama_cpp.built_server(root) is None or not gguf.is_file():
        pytest.skip("llama.cpp is not built here: `halfmoon bench build-llama-cpp` builds it")
    if len(os.sched_getaffinity(0)) % 2:
        pytest.skip("two servers need an even number of cores")
    cfg = FleetConfig("pa", servers=2, route="prefix", precision="fp32", parallel=2)
    body = {**chat(DOC), "max_tokens": 4, "temperature": 0}
    async with local_fleet(cfg, model_dir, tmp_path, llama_cpp.slot_tokens(600, 8)) as url:
        async with aiohttp.ClientSession() as http:
            first = await stream_chat(http, url, body)
            follow = await stream_chat(http, url, {**body, **chat(DOC + " Why?")})
            async with http.get(f"{url}/health") as resp:
                sent = (await resp.json())["sent"]
    assert first.ok and follow.ok, (first.error, follow.error)
    assert first.completion_tokens == follow.completion_tokens == 4
    assert sorted(sent) == [0, 2]  # both to the server that holds the document
    assert first.cached_tokens == 0 and follow.cached_tokens >= 200
    assert all((tmp_path / f"pa-{i}.log").read_text() for i in range(2))  # logs kept
