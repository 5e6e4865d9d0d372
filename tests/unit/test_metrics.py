"""Prometheus metrics: the shared /metrics server, per-object registries, and each service's
metrics fed by its real bookkeeping (gateway request life, conductor registry, KV index,
an engine instance on a random-weight model, real TCP transfers)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import aiohttp
import pytest
from prometheus_client import REGISTRY, Counter
from prometheus_client.parser import text_string_to_metric_families

from shared.kv_messages import KVMatchReply, KVMatchRequest
from shared.messages import (
    FinishReason,
    InstanceInfo,
    KVEvent,
    KVEventKind,
    KVHandle,
    Role,
    SamplingParams,
    TokenEvent,
    Usage,
)
from shared.metrics import exposition, new_registry, start_metrics_server
from shared.settings import parse_settings
from tests.conftest import free_port
from tests.factories import tiny_llama


def scrape(registry) -> dict[str, float]:
    """Every sample as 'name{k=v,...}' -> value."""
    out = {}
    for fam in text_string_to_metric_families(exposition(registry).decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def test_server_serves_its_registry_in_prometheus_text():
    reg = new_registry()
    Counter("halfmoon_demo_events", "demo", registry=reg).inc(3)
    port = free_port()
    runner = await start_metrics_server(reg, "127.0.0.1", port)
    assert runner is not None
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/other") as resp:
                assert resp.status == 404
    finally:
        await runner.cleanup()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["halfmoon_demo_events"].type == "counter"
    assert [s.value for s in fams["halfmoon_demo_events"].samples] == [3.0]
    assert "_created" not in text  # disabled: noise nobody reads


async def test_port_zero_is_off_and_a_taken_port_is_not_fatal(caplog):
    assert await start_metrics_server(new_registry(), "127.0.0.1", 0) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level(logging.WARNING, logger="shared.metrics"):
            got = await start_metrics_server(new_registry(), "127.0.0.1", taken.getsockname()[1])
    assert got is None
    assert "metrics not served" in caplog.text


def test_metrics_port_is_a_setting_of_every_service(monkeypatch):
    from services.conductor.args import ConductorSettings
    from services.decode.args import DecodeSettings
    from services.gateway.args import GatewaySettings
    from services.kvmanager.args import KVManagerSettings
    from services.prefill.args import PrefillSettings

    for cls in (
        ConductorSettings,
        DecodeSettings,
        GatewaySettings,
        KVManagerSettings,
        PrefillSettings,
    ):
        assert parse_settings(cls, [], "x").metrics_port == 0  # off unless asked
    monkeypatch.setenv("HALFMOON_METRICS_PORT", "9123")
    assert parse_settings(KVManagerSettings, [], "x").metrics_port == 9123
    assert parse_settings(KVManagerSettings, ["--metrics-port", "9124"], "x").metrics_port == 9124
    with pytest.raises(SystemExit):
        parse_settings(KVManagerSettings, ["--metrics-port", "70000"], "x")


def test_registries_are_per_object_never_global():
    from services.gateway.metrics import GatewayMetrics

    a, b = GatewayMetrics(), GatewayMetrics()  # a duplicate name in one registry would raise
    a.ttft.observe(0.5)
    assert scrape(a.registry)["halfmoon_ttft_seconds_count"] == 1
    assert scrape(b.registry)["halfmoon_ttft_seconds_count"] == 0
    assert REGISTRY.get_sample_value("halfmoon_ttft_seconds_count") is None


def _event(index: int, token: int, final: bool = False) -> TokenEvent:
    return TokenEvent(
        request_id="r",
        index=index,
        token_ids=[token],
        text="x",
        finish_reason=FinishReason.LENGTH if final else None,
        usage=Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=32) if final else None,
    )


def test_gateway_request_life_feeds_latencies_and_counts():
    from services.gateway.life import RequestLife
    from services.gateway.metrics import GatewayMetrics
    from shared import errors

    in_flight = [2]
    m = GatewayMetrics(lambda: in_flight[0])
    life = RequestLife("r", time.time() - 0.2, metrics=m)
    for i in range(3):
        life.on_event(_event(i, 100 + i, final=i == 2))
        time.sleep(0.01)
    m.finished(life, 40)
    m.rejected(errors.Rejected("busy", code="slo_unattainable"))
    m.rejected(errors.InvalidRequest("bad"))  # a client error is not a rejection
    got = scrape(m.registry)
    assert got["halfmoon_ttft_seconds_count"] == 1
    assert got["halfmoon_ttft_seconds_sum"] >= 0.2
    assert got["halfmoon_itl_seconds_count"] == 2
    assert got["halfmoon_itl_seconds_sum"] >= 0.02
    assert got["halfmoon_e2e_seconds_count"] == 1
    assert got["halfmoon_e2e_seconds_sum"] >= got["halfmoon_ttft_seconds_sum"]
    assert got["halfmoon_requests_total{status=completed}"] == 1
    assert got["halfmoon_requests_total{status=failed}"] == 0
    assert got["halfmoon_rejections_total{reason=slo_unattainable}"] == 1
    assert sum(v for k, v in got.items() if k.startswith("halfmoon_rejections_total")) == 1
    assert got["halfmoon_prompt_tokens_total"] == 40
    assert got["halfmoon_generation_tokens_total"] == 3
    assert got["halfmoon_cached_prompt_tokens_total"] == 32
    assert got["halfmoon_requests_in_flight"] == 2


def test_conductor_counts_live_instances_by_role():
    from services.conductor.metrics import ConductorMetrics
    from services.conductor.registry import Registry

    reg = Registry(expiry_s=3.0)
    now = time.time()
    reg.seen(InstanceInfo(instance_id="p0", role=Role.PREFILL), now)
    reg.seen(InstanceInfo(instance_id="p1", role=Role.PREFILL), now - 10)  # silent: dead
    reg.seen(InstanceInfo(instance_id="d0", role=Role.DECODE), now)
    m = ConductorMetrics(reg)
    m.placed("kvcentric", 0.002)
    m.rejected("slo_unattainable", 0.001)
    got = scrape(m.registry)
    assert got["halfmoon_conductor_live_instances{role=prefill}"] == 1
    assert got["halfmoon_conductor_live_instances{role=decode}"] == 1
    assert got["halfmoon_conductor_live_instances{role=gateway}"] == 0
    assert got["halfmoon_conductor_placements_total{policy=kvcentric}"] == 1
    assert got["halfmoon_conductor_rejections_total{reason=slo_unattainable}"] == 1
    assert got["halfmoon_conductor_placement_seconds_count{outcome=placed}"] == 1


class _Msg:
    """What a NATS request looks like to a handler: data, and somewhere to reply."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reply, self.replies = data, "inbox", []

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


async def test_kvmanager_metrics_read_the_index_and_match_totals():
    from services.kvmanager.handlers import KVManager
    from services.kvmanager.metrics import KVManagerMetrics

    manager = KVManager()
    m = KVManagerMetrics(manager)
    manager.apply(
        KVEvent(
            kind=KVEventKind.STORED, instance_id="p0", block_hashes=[1, 2, 3], block_nbytes=100
        ),
        time.time(),
    )
    manager.apply(
        KVEvent(
            kind=KVEventKind.STORED,
            instance_id="p0",
            tier="disk",
            block_hashes=[9],
            block_nbytes=100,
        ),
        time.time(),
    )
    msg = _Msg(KVMatchRequest(block_hashes=[1, 2, 7, 8]).encode())
    await manager.on_match(msg)
    assert KVMatchReply.model_validate_json(msg.replies[0]).matches == {"p0": 2}
    got = scrape(m.registry)
    assert got["halfmoon_kvmanager_index_blocks"] == 4
    assert got["halfmoon_kvmanager_blocks{instance_id=p0,tier=dram}"] == 3
    assert got["halfmoon_kvmanager_blocks{instance_id=p0,tier=disk}"] == 1
    assert got["halfmoon_kvmanager_block_bytes{instance_id=p0,tier=dram}"] == 300
    assert got["halfmoon_kvmanager_events_total"] == 2
    assert got["halfmoon_kvmanager_match_requests_total"] == 1
    assert got["halfmoon_kvmanager_match_blocks_total"] == 4
    assert got["halfmoon_kvmanager_match_hit_blocks_total"] == 2


def test_up_gives_each_child_its_own_metrics_port():
    from services.up import LocalCluster, UpSettings
    from services.up.banner import metrics_lines

    c = LocalCluster(UpSettings(metrics_base_port=9200))
    ports = [
        c._metrics_env(n, r)["HALFMOON_METRICS_PORT"]
        for n, r in [
            ("conductor", "conductor"),
            ("kvmanager", "kvmanager"),
            ("prefill-0", "prefill"),
            ("decode-0", "decode"),
            ("gateway", "gateway"),
        ]
    ]
    assert ports == ["9200", "9201", "9202", "9203", "0"]
    assert c._metrics_env("prefill-0", "prefill")["HALFMOON_METRICS_PORT"] == "9202"  # restart
    assert c._metrics_env("console", "console") == {}
    lines = "\n".join(metrics_lines(c.s, c))
    assert "http://127.0.0.1:8000/metrics (gateway)" in lines
    assert "http://127.0.0.1:9203/metrics (decode-0)" in lines
    off = LocalCluster(UpSettings(metrics_base_port=0))
    assert off._metrics_env("conductor", "conductor")["HALFMOON_METRICS_PORT"] == "0"
    assert off.metrics_ports == {}


# -- an engine instance ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


async def stranger() -> KVHandle:
    """A handle to a server that answers one fetch with an HTTP response, then closes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.close()
        await reader.read(100)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return KVHandle(transfer_id="x", host="127.0.0.1", port=port, nbytes=16, num_tokens=1)


async def test_engine_metrics_from_a_real_instance_and_real_transfers(tiny, tmp_path):
    from services.prefill.args import PrefillSettings
    from services.prefill.handlers import PrefillInstance
    from services.worker.metrics import EngineMetrics
    from shared.engine.params import SamplingParams as EngineParams
    from shared.transfer import TransferFailed
    from shared.transfer.tcp import TcpKVReceiver, TcpKVSender

    settings = PrefillSettings(
        instance_id="prefill-t",
        kv_cache_gb=4 / 1024,
        disk_tier_gb=0.001,
        disk_tier_dir=str(tmp_path),
    )
    sender, receiver = TcpKVSender(), TcpKVReceiver()
    await sender.start()
    inst = PrefillInstance(settings, None, tiny, sender, receiver)  # type: ignore[arg-type]
    try:
        m = EngineMetrics(inst)
        # b reuses all of a's prompt but its last token (2 full blocks, then the kept
        # partial block's first 7 tokens: one is always computed).
        prompt = list(range(1, 41))
        for rid in ("a", "b"):
            inst.engine.add_request(
                rid, prompt, EngineParams(temperature=0, max_tokens=2, ignore_eos=True)
            )
            while inst.engine.has_work():
                inst.engine.step()
        inst._stats = inst.engine.stats()

        handoff = sender.offer("handoff", b"{}", b"\x01" * 65536, 40, ttl_s=10)
        meta, payload = await receiver.fetch(handoff, timeout_s=10)
        assert len(payload) == 65536
        dead = sender.offer("prefix", b"{}", b"\x02" * 16, 1, ttl_s=0.05)  # never fetched
        await sender.wait(handoff.transfer_id, 5)
        await sender.wait(dead.transfer_id, 5)
        with pytest.raises(TransferFailed):  # expired: refused, and counted
            await receiver.fetch(dead, timeout_s=5, purpose="prefix")
        with pytest.raises(TransferFailed):  # a sender that answers with another protocol
            await receiver.fetch(await stranger(), timeout_s=5, purpose="prefix")
        inst.engine.kv_load_failures.failed("pull")  # as a failed prefix pull counts it
        got = scrape(m.registry)
    finally:
        inst.close_engine()
        await sender.close()
    assert got["halfmoon_engine_info{instance_id=prefill-t,model=tiny,role=prefill}"] == 1
    assert got["halfmoon_kv_load_failures_total{kind=pull,outcome=recomputed}"] == 1
    assert got["halfmoon_kv_load_failures_total{kind=disk,outcome=failed}"] == 0
    assert got["halfmoon_prefix_cache_hit_tokens_total"] == 39
    assert got["halfmoon_prefix_cache_miss_tokens_total"] == 40 + 1
    assert got["halfmoon_engine_waiting_requests"] == 0
    assert got["halfmoon_engine_running_requests"] == 0
    total = inst.engine.blocks.num_blocks
    assert got["halfmoon_kv_blocks{state=free,tier=dram}"] == total  # all finished
    assert got["halfmoon_kv_blocks{state=used,tier=dram}"] == 0
    assert got["halfmoon_kv_cached_blocks{tier=dram}"] >= 2
    assert got["halfmoon_kv_capacity_bytes{tier=disk}"] == int(0.001 * 2**30)
    assert got["halfmoon_engine_step_seconds_count"] >= 4
    assert got["halfmoon_engine_step_tokens_total"] == 40 + 1 + 1 + 1  # b: its last token
    assert got["halfmoon_kv_transfer_seconds_count{direction=out,purpose=handoff}"] == 1
    assert got["halfmoon_kv_transfer_seconds_count{direction=in,purpose=handoff}"] == 1
    assert got["halfmoon_kv_transfer_seconds_sum{direction=in,purpose=handoff}"] > 0
    assert got["halfmoon_kv_transfer_failures_total{direction=out,purpose=prefix}"] == 1
    assert got["halfmoon_kv_transfer_failures_total{direction=in,purpose=prefix}"] == 2  # +stranger
    assert got["halfmoon_kv_transfer_refused_total"] == 1
    assert got["halfmoon_kv_transfer_bad_frames_total"] == 1
    assert "halfmoon_engine_pending_imports" not in got  # prefill has no import queue
