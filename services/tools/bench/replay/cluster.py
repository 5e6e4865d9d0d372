"""A fresh local cluster per configuration, started the way users start it (`halfmoon up`),
so a comparison measures exactly what people run."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from services.conductor.costmodel import default_path as default_cost_model
from services.tools.bench.placement import parse_cpus, placements
from services.tools.bench.servers import HalfmoonServer

_ENV_TOKEN = re.compile(r"^HALFMOON_[A-Z0-9_]+=")


@dataclass(frozen=True)
class ClusterConfig:
    """A name and the `halfmoon up` flags that make it; HALFMOON_X=Y tokens among them are
    environment for every service (e.g. HALFMOON_BALANCING_THRESHOLD=inf for the conductor)."""

    name: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> ClusterConfig:
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip() or name.strip().startswith("-"):
            raise ValueError(
                f"config {spec!r}: expected NAME=FLAGS, e.g. 'colocated=--colocated 2'"
            )
        flags, env = [], {}
        for token in shlex.split(rest):
            if _ENV_TOKEN.match(token):
                key, _, value = token.partition("=")
                env[key] = value
            else:
                flags.append(token)
        return cls(name.strip(), tuple(flags), env)

    def describe(self) -> str:
        return " ".join([*self.flags, *(f"{k}={v}" for k, v in self.env.items())])


@contextlib.asynccontextmanager
async def local_cluster(
    config: ClusterConfig, model_dir: Path, log_dir: Path, ready_timeout_s: float = 300.0
) -> AsyncIterator[str]:
    """Start `halfmoon up` with the config's flags in a scratch home (its own SQLite and
    NATS store); yield the gateway URL; stop it as Ctrl-C would; keep its log."""
    env = dict(config.env)
    if "HALFMOON_COST_MODEL" not in env and default_cost_model().exists():
        env["HALFMOON_COST_MODEL"] = str(default_cost_model())  # the one fitted here
    # No metrics ports unless asked for: a benchmark cluster must not collide with a running one.
    metrics = (
        [] if any(f.startswith("--metrics") for f in config.flags) else ["--metrics-base-port", "0"]
    )
    flags = [*metrics, *config.flags]
    # On every core this process may use, with `up`'s own thread split (or the flags').
    placement = placements(parse_cpus(""), flags)[0]
    server = HalfmoonServer(model_dir, "auto", placement, flags, env=env)
    try:
        await asyncio.to_thread(server.start, ready_timeout_s)
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)
        (log_dir / f"{config.name}.log").write_text("".join(server.log))
