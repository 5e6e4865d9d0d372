"""`halfmoon up` hands the served context and the pool size to the gateway and to every
engine alike, in flags their own settings accept."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.decode.args import DecodeSettings
from services.gateway.args import GatewaySettings
from services.prefill.args import PrefillSettings
from services.up import LocalCluster, UpSettings
from shared.settings import parse_settings

PARSERS = {
    "services.prefill": PrefillSettings,
    "services.decode": DecodeSettings,
    "services.gateway": GatewaySettings,
}


def spawned(settings: UpSettings) -> dict[str, list[str]]:
    """Each child's command line, as start() would run it (nothing is started)."""
    cluster = LocalCluster(settings)
    seen: dict[str, list[str]] = {}

    async def record(name: str, role: str, args: list[str], env=None) -> None:
        seen[name] = args

    cluster._spawn = record  # type: ignore[method-assign]
    asyncio.run(cluster.start(Path("/models/m")))
    return seen


def test_the_context_and_pool_reach_the_gateway_and_every_engine():
    up = UpSettings(
        console=False, prefill=2, max_model_len=16384, rope_scaling="yarn:4", kv_cache_gb=2.0
    )
    children = spawned(up)
    assert {"prefill-0", "prefill-1", "decode-0", "gateway"} <= set(children)
    for name, args in children.items():
        module, flags = args[1], args[2:]
        if module not in PARSERS:
            continue
        s = parse_settings(PARSERS[module], flags, module)
        assert (s.max_model_len, s.rope_scaling) == (16384, "yarn:4"), name
        if module != "services.gateway":
            assert s.kv_cache_gb == 2.0, name


def test_unset_they_leave_each_service_its_own_default(monkeypatch):
    monkeypatch.setenv("HALFMOON_KV_CACHE_GB", "3")  # an operator's variable still counts
    for name, args in spawned(UpSettings(console=False)).items():
        assert "--rope-scaling" not in args and "--max-model-len" not in args, name
        if args[1] == "services.decode":
            assert parse_settings(DecodeSettings, args[2:], "d").kv_cache_gb == 3.0


def test_speculation_reaches_the_instances_that_decode_alone():
    for up, decoding in (
        (UpSettings(console=False, num_speculative_tokens=4), {"decode-0"}),
        (
            UpSettings(console=False, colocated=2, num_speculative_tokens=4),
            {"colocated-0", "colocated-1"},
        ),
    ):
        for name, args in spawned(up).items():
            if args[1] not in ("services.prefill", "services.decode"):
                continue
            s = parse_settings(PARSERS[args[1]], args[2:], args[1])
            assert s.num_speculative_tokens == (4 if name in decoding else 0), name
    for args in spawned(UpSettings(console=False)).values():
        assert "--num-speculative-tokens" not in args  # unset: each engine's own default


def test_a_tool_format_reaches_the_gateway_alone():
    for name, args in spawned(UpSettings(console=False, tool_format="mistral")).items():
        if args[1] == "services.gateway":
            assert parse_settings(PARSERS[args[1]], args[2:], args[1]).tool_format == "mistral"
        else:
            assert "--tool-format" not in args, name


def test_lean_weights_reach_every_engine():
    for name, args in spawned(UpSettings(console=False, lean_weights=True)).items():
        if args[1] in ("services.prefill", "services.decode"):
            s = parse_settings(PARSERS[args[1]], args[2:], args[1])
            assert s.lean_weights and s.engine_config().lean_weights, name
    for args in spawned(UpSettings(console=False)).values():
        assert "--lean-weights" not in args
