"""The faults a cluster of hosts has, one at a time under a steady load, each measured.

- nats-node:    host c's NATS server dies (two of three keep quorum and the R3 state);
- decode-host:  every process on host d dies (the decode instance);
- prefill-host: every process on host c dies (the prefill instance and NATS node 3);
- link-down:    host d's link goes down for `link_down_s` in the middle of a handoff (of a
                long prompt, at its first token, the link throttled so that the handoff
                lasts long enough to be cut), then comes back;
- leader-host:  every process on host a dies (a gateway, the leading conductor, NATS node 1).

A host that died comes back as a machine would: the harness's supervisor starts its
processes again. Each fault reports how long until the service was whole again (every
process alive, and a chat request answered through every gateway), and how each request
sent from a little before the fault to a little after it ended.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from services.tools.bench.client import Result, stream_chat
from services.tools.chaos.load import make_body
from services.tools.hosts.cluster import HostCluster

log = logging.getLogger("halfmoon.hosts")
FAULTS = ("nats-node", "decode-host", "prefill-host", "link-down", "leader-host")


# What a fault does; it returns the request it aimed at, if it aimed at one.
Inject = Callable[[HostCluster, str], Awaitable[Result | None]]
CAUGHT_TOKENS = 8  # the request a link cut catches mid-handoff streams this many
HANDOFF_MBIT = 100.0  # its link's rate: a long prompt's KV then takes about a second


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    inject: Inject


async def _kill_nats_node(c: HostCluster, model: str) -> None:
    node = c.nodes["c"]
    if node.proc is not None:
        node.proc.kill()


def _kill_host(name: str) -> Inject:
    async def kill(c: HostCluster, model: str) -> None:
        await asyncio.to_thread(c.net.kill_host, c.t.host(name))

    return kill


def _link_down(seconds: float) -> Inject:
    async def cut(c: HostCluster, model: str) -> Result:
        host = c.t.host("d")
        c.net.throttle(host, HANDOFF_MBIT)
        first = asyncio.Event()
        body = make_body(model, random.Random(3), CAUGHT_TOKENS, long_share=1.0, long_words=300)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            caught = asyncio.create_task(stream_chat(http, c.t.gateway_urls()[0], body, first))
            try:
                async with asyncio.timeout(120):  # prefill's first token: the handoff begins
                    await first.wait()
            except TimeoutError:
                log.warning("link-down: no first token in 120 s; cutting the link anyway")
            c.net.link(host, up=False)
            await asyncio.sleep(seconds)  # the outage itself: how long the link stays down
            c.net.link(host, up=True)
            c.net.unthrottle(host)
            return await caught

    return cut


def faults(link_down_s: float) -> dict[str, Fault]:
    return {
        "nats-node": Fault("nats-node", "NATS node 3 (host c) killed", _kill_nats_node),
        "decode-host": Fault("decode-host", "host d (decode) lost", _kill_host("d")),
        "prefill-host": Fault(
            "prefill-host", "host c (prefill, NATS node 3) lost", _kill_host("c")
        ),
        "link-down": Fault(
            "link-down",
            f"host d's link down for {link_down_s:g} s, mid-handoff",
            _link_down(link_down_s),
        ),
        "leader-host": Fault(
            "leader-host",
            "host a (gateway, leading conductor, NATS node 1) lost",
            _kill_host("a"),
        ),
    }


def everything_alive(c: HostCluster) -> bool:
    procs = all(child.proc.returncode is None for child in c.children)
    nodes = all(n.proc is not None and n.proc.poll() is None for n in c.nodes.values())
    return procs and nodes


async def probe(url: str, model: str, timeout_s: float) -> bool:
    """One short greedy chat through `url`: answered in full, or not."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as h:
            async with h.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def whole_again(c: HostCluster, model: str, t0: float, limit_s: float) -> float | None:
    """Seconds from `t0` until every process is alive and every gateway answers a chat;
    None if that did not happen within `limit_s`."""
    while time.monotonic() - t0 < limit_s:
        if everything_alive(c):
            answers = [await probe(url, model, 20.0) for url in c.t.gateway_urls()]
            if all(answers):
                return time.monotonic() - t0
        await asyncio.sleep(0.5)
    return None
