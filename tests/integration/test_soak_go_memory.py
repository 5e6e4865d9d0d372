"""The soak reads a real nats-server's own memory accounting: its profiling endpoint, opened
by the embedded config's `prof_port`, gives Go's Sys and heap, beside the process's RSS."""

from __future__ import annotations

import aiohttp

from services.tools.bench.placement import free_port
from services.tools.soak.sample import Samples, sample_go
from shared.natsd import EmbeddedNats


async def test_the_soak_samples_a_live_nats_servers_go_memory(tmp_path):
    server = EmbeddedNats(tmp_path / "nats", prof_port=free_port())
    server.start()
    try:
        assert server.proc is not None
        samples = Samples(warmup_s=0)
        series = samples.process("nats-server", server.proc.pid, 0.0)
        assert series == f"nats-server (pid {server.proc.pid})"
        async with aiohttp.ClientSession() as http:
            await sample_go(http, f"http://127.0.0.1:{server.prof_port}", series, samples, 0.0)
        (_, go_sys), (_, heap) = (
            samples.points[(series, "go_sys_mib")][0],
            samples.points[(series, "go_heap_mib")][0],
        )
        (_, anon), (_, rss) = (
            samples.points[(series, "rss_anon_mib")][0],
            samples.points[(series, "rss_mib")][0],
        )
        # A fresh server holds a few MiB: its heap within Sys, its private RSS too.
        assert 0 < heap < go_sys < 256
        assert 0 < anon <= go_sys + 1 and anon < rss
    finally:
        server.stop()
