"""`halfmoon bench cpp`: a long prompt's time to first token on a pipelined prefill group
(Mooncake FAST'25 §3.3) against one instance, through the live stack, on the same cores.

Three layouts of `halfmoon up`, one after the other, each pinned to the same cores:
- one instance on one core: one prefill engine pinned to a core, decode on the other;
- a 2-stage group, a core each: two prefill engines pinned apart, with groups on
  (HALFMOON_MAX_STAGES=2), so every long prompt runs half the layers on each;
- one instance on both cores: one prefill engine with two threads, unpinned.
Each gets the same prompts: token ids cut from one long text (this Python's standard
library sources), a different stretch per request so nothing is cached, sent as
/v1/completions with 2 new tokens, streamed; TTFT is the client's, to the first token.
Each stack is warmed up the same way first (a short prompt, then a 1,024-token one).
Each measured prompt waits until the conductor has seen the prefill instances idle, and
its decision record must show the layout's placement (a group's stages, or one instance):
a prompt placed otherwise stops the bench rather than report another layout's time.
Contexts past the model's trained 8,192 positions run every layout with the same
--rope-scaling (yarn:4 by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import sys
import time
from contextlib import closing
from typing import Any, Sequence

import aiohttp

from services.tools.bench.context import long_text
from services.tools.bench.placement import Placement, format_cpus, parse_cpus
from services.tools.bench.servers import HalfmoonServer
from services.tools.decisions import stages_of
from shared.db.session import sqlite_file
from shared.engine.runner import load_model
from shared.model_store import ensure_model
from shared.settings import BaseSettings

TRAINED = 8_192
NEW_TOKENS = 2  # per request: the first token, and one more so decode takes it over
HEARTBEAT_S: float = BaseSettings.model_fields["heartbeat_interval_s"].default
WARM_TOKENS = 1_024
# A prefill instance reports itself idle within a heartbeat or two of its last prompt.
IDLE_WAIT_S = 30 * HEARTBEAT_S
# The gateway's first-token wait (300 s by default) is shorter than one core's 16k
# prefill on a slow CPU: the bench waits as long as its client does.
LONG_WAITS = {"HALFMOON_FIRST_TOKEN_TIMEOUT_S": "3600"}

# name -> (`up` flags, env, engines, threads each)
LAYOUTS: dict[str, tuple[list[str], dict[str, str], int, int]] = {
    "one instance, one core": (
        ["--prefill", "1", "--decode", "1", "--pin-engines"],
        {},
        2,
        1,
    ),
    "2-stage group, a core each": (
        ["--prefill", "2", "--decode", "1", "--pin-engines"],
        # the warm-up's 1,024-token prompt runs on the group too (its stage pools made)
        {"HALFMOON_MAX_STAGES": "2", "HALFMOON_PIPELINE_MIN_TOKENS": str(WARM_TOKENS)},
        3,
        1,
    ),
    "one instance, both cores": (["--prefill", "1", "--decode", "1"], {}, 2, 2),
}


async def ttft(url: str, model: str, ids: list[int]) -> tuple[float, str]:
    """Seconds from sending `ids` to the first streamed token, and the request's id
    (RuntimeError on a failure)."""
    # TTFT is measured, not admission: a long prompt alone is served however slowly one
    # core prefills it (the default 30 s TTFT SLO would refuse it).
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": NEW_TOKENS,
        "stream": True,
        "temperature": 0,
        "ttft_slo_ms": 3_600_000,
        "tbt_slo_ms": 60_000,
    }
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if "error" in obj:
                    raise RuntimeError(str(obj["error"])[:300])
                if any(c.get("text") for c in obj.get("choices") or []):
                    return time.perf_counter() - t0, str(obj.get("id", ""))
    raise RuntimeError("the stream ended without a token")


def prompts(ids: list[int], sizes: list[int], runs: int) -> dict[int, list[list[int]]]:
    """`runs` prompts of each size, each a stretch of `ids` no other prompt shares."""
    out: dict[int, list[list[int]]] = {}
    at = 0
    for n in sizes:
        out[n] = []
        for _ in range(runs):
            out[n].append(ids[at : at + n])
            at += n
    return out


def placed_on(server: HalfmoonServer, request_id: str) -> int:
    """stages_of() the request's decision, read from the stack's SQLite database."""
    with closing(sqlite3.connect(sqlite_file(server.tmp / "home"))) as db:
        row = db.execute(
            "select predicted_ttft_ms, candidates from decisions where request_id = ?",
            (request_id,),
        ).fetchone()
    return stages_of(*row) if row else 0


def idle_since(info: dict[str, Any], since: float) -> bool:
    """An instance's heartbeat (as GET /admin/state lists it) sent after `since` (wall
    clock) with nothing queued or running: what the conductor needs to see before it
    forms a group, since a group forms from idle instances only."""
    quiet = info["queue_depth"] == 0 and info["running"] == 0 and not info["queue_prompts"]
    return info["sent_at"] > since and quiet


async def prefills_idle(url: str, since: float) -> None:
    """Until every prefill instance has reported itself idle in a heartbeat sent after
    `since`. The conductor hears the same heartbeat; should a prompt still reach it
    first, the placement check refuses that prompt's figure."""
    deadline = time.monotonic() + IDLE_WAIT_S
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{url}/admin/state") as resp:
                resp.raise_for_status()
                instances = (await resp.json())["instances"]
            prefills = [i for i in instances if i["role"] == "prefill"]
            if prefills and all(idle_since(i, since) for i in prefills):
                return
            if time.monotonic() > deadline:
                busy = [i["instance_id"] for i in prefills if not idle_since(i, since)]
                raise RuntimeError(f"prefill instances not idle after {IDLE_WAIT_S:.0f} s: {busy}")
            await asyncio.sleep(HEARTBEAT_S / 10)


async def one(server: HalfmoonServer, model: str, ids: list[int], stages: int) -> float:
    """A request's TTFT, once every prefill instance has reported itself idle after the
    request before, and checked to have run on `stages` instances: a figure from another
    layout is refused."""
    await prefills_idle(server.url, time.time())
    seconds, rid = await ttft(server.url, model, ids)
    got = placed_on(server, rid)
    if got != stages:
        raise RuntimeError(f"{len(ids)}-token prompt {rid}: ran on {got} instances, not {stages}")
    return seconds


async def measure(
    server: HalfmoonServer,
    model: str,
    work: dict[int, list[list[int]]],
    warm: list[list[int]],
    stages: int,
) -> dict[int, list[float]]:
    for w in warm[:-1]:
        await ttft(server.url, model, w)
    # The last warm-up runs on the layout too: a group's first prompt builds each stage's
    # pool and weights, which no measured prompt should pay.
    await one(server, model, warm[-1], stages)
    return {n: [await one(server, model, p, stages) for p in ps] for n, ps in work.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(args.model)
    cpus = parse_cpus(args.cpus)
    if len(cpus) < 2:
        raise SystemExit("bench cpp needs two cores (--cpus)")
    cpus = cpus[:2]
    sizes = [int(x) for x in args.tokens.split(",")]
    tokenizer = load_model(model_dir, "float32").tokenizer
    need = (len(sizes) * args.runs + 2) * max(sizes)
    ids = long_text(args.text, tokenizer, need)
    work = prompts(ids[2 * max(sizes) :], sizes, args.runs)
    warm = [ids[:8], ids[max(sizes) : max(sizes) + WARM_TOKENS]]
    # A prompt of the trained length leaves no room for its new tokens: stretch it too.
    long = max(sizes) + NEW_TOKENS > TRAINED
    context = ["--rope-scaling", args.rope_scaling] if long else []
    common = [*context, "--kv-cache-gb", str(args.kv_cache_gb), *args.halfmoon_args.split()]
    result: dict[str, Any] = {"cpus": format_cpus(cpus), "dtype": args.dtype, "layouts": {}}
    for name, (flags, env, engines, threads) in LAYOUTS.items():
        placement = Placement(cpus, engines, threads)
        env = {**env, **LONG_WAITS, "HALFMOON_STAGE_KV_GB": str(args.kv_cache_gb)}
        server = HalfmoonServer(model_dir, args.dtype, placement, [*flags, *common], env)
        print(f"bench cpp: {name} ...", file=sys.stderr, flush=True)
        server.start()
        stages = int(env.get("HALFMOON_MAX_STAGES", "1"))
        try:
            got = asyncio.run(measure(server, model_dir.name, work, warm, stages))
        finally:
            server.stop()
        result["layouts"][name] = {str(n): times for n, times in got.items()}
    return result


def render(r: dict[str, Any]) -> str:
    names = list(LAYOUTS)
    base, group, both = names
    lines = [
        f"bench cpp: TTFT (s, median) of a fresh prompt, cores {r['cpus']}, {r['dtype']}",
        f"{'tokens':>7}  {base:>24} {group:>28} {both:>26}  group/one  both/one",
    ]
    sizes = sorted({int(n) for layout in r["layouts"].values() for n in layout})
    for n in sizes:
        t = {k: statistics.median(r["layouts"][k][str(n)]) for k in names}
        lines.append(
            f"{n:>7}  {t[base]:>24.2f} {t[group]:>28.2f} {t[both]:>26.2f}  "
            f"{t[group] / t[base]:>9.2f} {t[both] / t[base]:>9.2f}"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench cpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="", help="model folder (default: the pulled default model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--tokens", default="8192,16384", help="prompt sizes, comma-separated")
    p.add_argument("--runs", type=int, default=1, help="prompts of each size per layout")
    p.add_argument("--cpus", default="", help="the two cores (default: the first two allowed)")
    p.add_argument("--rope-scaling", default="yarn:4", help="for sizes past 8,192 tokens")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="each engine's and stage's pool")
    p.add_argument("--text", default="", help="the long text (default: the stdlib sources)")
    p.add_argument("--halfmoon-args", default="", help="more `halfmoon up` flags, every layout")
    p.add_argument("--json-out", default="", help="also write the JSON document here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    print(render(result), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
