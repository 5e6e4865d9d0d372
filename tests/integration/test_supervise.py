"""`halfmoon up`'s supervision on real processes: a child that dies is started again with
the same command (after a backoff that grows while it keeps dying young), the embedded
nats-server comes back on its port, and with --no-restart a death ends the run."""

from __future__ import annotations

import asyncio
import signal
import time

import nats
import pytest

from services.up import LocalCluster, UpSettings
from shared.natsd import EmbeddedNats

SLEEPER = ["-c", "import time; time.sleep(60)"]


async def pass_until(cluster: LocalCluster, cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "supervisor did not act in time"
        await cluster.supervise(time.monotonic())
        await asyncio.sleep(0.05)


async def test_a_dead_child_is_started_again_with_backoff(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path))
    cluster = LocalCluster(UpSettings(restart_backoff_s=0.2, metrics_base_port=0))
    await cluster._spawn("sleeper", "kvmanager", SLEEPER)
    child = cluster.children[0]
    try:
        first = child.proc.pid
        child.proc.send_signal(signal.SIGKILL)
        await child.proc.wait()
        t0 = time.monotonic()
        await pass_until(cluster, lambda: child.restarts == 1)
        assert child.proc.pid != first and child.proc.returncode is None
        assert time.monotonic() - t0 >= 0.2  # the backoff
        child.proc.send_signal(signal.SIGKILL)  # dies young again: twice the wait
        await child.proc.wait()
        now = time.monotonic()
        await cluster.supervise(now)  # the pass that notes the death sets its restart time
        assert child.restart_at == pytest.approx(now + 2 * 0.2)
        await pass_until(cluster, lambda: child.restarts == 2)
    finally:
        await cluster.stop()
    assert child.proc.returncode is not None  # stop() stops the restarted process


async def test_nats_comes_back_on_the_same_port(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path))
    cluster = LocalCluster(UpSettings(metrics_base_port=0))
    cluster.nats = EmbeddedNats(tmp_path / "nats")
    cluster.nats_url = cluster.nats.start()
    try:
        cluster.nats.proc.kill()
        cluster.nats.proc.wait()
        await pass_until(cluster, lambda: cluster.nats.proc.poll() is None)
        assert cluster.nats.url == cluster.nats_url
        nc = await nats.connect(cluster.nats_url)
        await nc.close()
    finally:
        await cluster.stop()


async def test_without_restart_a_death_ends_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_HOME", str(tmp_path))
    cluster = LocalCluster(UpSettings(restart=False, metrics_base_port=0))
    await cluster._spawn("sleeper", "kvmanager", SLEEPER)
    cluster.children[0].proc.send_signal(signal.SIGKILL)
    try:
        assert await asyncio.wait_for(cluster.watch(asyncio.Event()), 10) == 1
    finally:
        await cluster.stop()
