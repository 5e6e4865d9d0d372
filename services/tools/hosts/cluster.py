"""The Halfmoon cluster on the hosts of a Topology: LocalCluster's processes, supervision
and ordered stop, with each process started on its host (`ip netns exec`), listening on
the host's address, and NATS as a three-node cluster with JetStream replicated (R3).

Order: the network, the relay to the machine's database, the NATS nodes (until JetStream
has a leader), the leading conductor (until it leads), then everything else.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import nats
from nats.aio.msg import Msg

from services.tools.hosts.netns import Network
from services.tools.hosts.relay import Relay, loopback_port, via
from services.tools.hosts.settings import HostsSettings
from services.tools.hosts.topology import GATEWAY_PORT, NATS_CLUSTER_PORT, Host, Topology
from services.up.cluster import LocalCluster
from shared import subjects
from shared.lifecycle import child_preexec
from shared.messages import InstanceInfo
from shared.natsd import EmbeddedNats

log = logging.getLogger("halfmoon.hosts")
NATS_REPLICAS = "3"  # the lease bucket and the KV event stream: one copy per NATS node


class HostCluster(LocalCluster):
    def __init__(self, settings: HostsSettings, topology: Topology) -> None:
        super().__init__(settings)
        self.hs = settings
        self.t = topology
        self.net = Network(topology)
        self.nodes: dict[str, EmbeddedNats] = {}  # host name -> its NATS node
        self.relay: Relay | None = None
        self.where: dict[str, Host] = {}  # child name -> the host it runs on

    def expected(self) -> Counter[str]:
        return Counter(
            {
                "gateway": len(self.t.with_role("gateway")),
                "conductor": len(self.t.with_role("conductor")),
                "kvmanager": len(self.t.with_role("kvmanager")),
                "prefill": self.s.prefill,
                "decode": self.s.decode,
            }
        )

    async def network_up(self) -> None:
        """The hosts, the database as they reach it, and the NATS cluster."""
        await asyncio.to_thread(self.net.create)
        port = loopback_port(self.database_url)
        if port:
            self.relay = Relay(self.t.bridge_address, port)
            relayed = await self.relay.start()
            self.database_url = via(self.database_url, self.t.bridge_address, relayed)
        for host in self.t.with_role("nats"):
            node = EmbeddedNats(
                self.home / "hosts" / self.t.netns(host) / "nats",
                port=4222,
                host=host.address,
                server_name=f"nats-{host.name}",
                cluster_name=f"halfmoon-{self.t.run_id}",
                cluster_port=NATS_CLUSTER_PORT,
                routes=self.t.nats_routes(host),
                launcher=self.net.launcher(host),
            )
            self.nodes[host.name] = node
            await asyncio.to_thread(node.start)
        self.nats_url = ",".join(self.t.nats_urls())
        await self._wait_jetstream()

    async def _wait_jetstream(self, timeout_s: float = 60.0) -> None:
        """Until the nodes have formed a cluster and elected a JetStream meta leader."""
        nc = await nats.connect(self.t.nats_urls())
        try:
            js = nc.jetstream(timeout=2)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    await js.account_info()
                    return
                except Exception as exc:  # any answer but a good one: not yet
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"JetStream cluster not ready: {exc}") from exc
                await asyncio.sleep(0.5)
        finally:
            await nc.close()

    async def _exec(
        self, name: str, role: str, args: list[str], env: dict[str, str]
    ) -> asyncio.subprocess.Process:
        host = self.where[name]
        return await asyncio.create_subprocess_exec(
            *self.net.launcher(host),
            sys.executable,
            *args,
            env={**self._env(), **self._metrics_env(name, role), **self._host_env(host), **env},
            preexec_fn=child_preexec,
        )

    @staticmethod
    def _host_env(host: Host) -> dict[str, str]:
        """Every service on `host` listens on its address: metrics and the KV data plane."""
        return {"HALFMOON_METRICS_HOST": host.address, "HALFMOON_KV_HOST": host.address}

    async def _spawn_on(
        self, host: Host, name: str, role: str, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.where[name] = host
        await self._spawn(name, role, args, env)

    async def start(self, model_dir: Path) -> None:
        s = self.s
        conductor = ["--policy", s.policy, "--layout", "disaggregated", "--planner", s.planner]
        for i, host in enumerate(self.t.with_role("conductor")):
            name = f"conductor-{host.name}"
            args = ["-m", "services.conductor", "--instance-id", name, *conductor]
            await self._spawn_on(host, name, "conductor", args, {"HALFMOON_LEASE_REPLICAS": "3"})
            if i == 0:  # the first one leads: the others start as its standbys
                await self._wait_leader(name)
        for host in self.t.with_role("kvmanager"):
            args = ["-m", "services.kvmanager", "--instance-id", f"kvmanager-{host.name}"]
            env = {"HALFMOON_STREAM_REPLICAS": NATS_REPLICAS}
            await self._spawn_on(host, f"kvmanager-{host.name}", "kvmanager", args, env)
        engine = self._engine_args(model_dir)
        for role, count in (("prefill", s.prefill), ("decode", s.decode)):
            hosts = self.t.with_role(role)
            for i in range(count):
                host = hosts[i % len(hosts)]
                name = f"{role}-{host.name}{i}"
                extra = self._decoding_args() if role == "decode" else []
                args = ["-m", f"services.{role}", "--instance-id", name, *engine, *extra]
                await self._spawn_on(host, name, role, args)
        common = ["--model", str(model_dir), *self._context_args()]
        for host in self.t.with_role("gateway"):
            args = ["-m", "services.gateway", "--host", host.address, "--port", str(GATEWAY_PORT)]
            await self._spawn_on(host, f"gateway-{host.name}", "gateway", args + common)

    async def _wait_leader(self, name: str, timeout_s: float = 60.0) -> None:
        led = asyncio.Event()

        async def on_beat(msg: Msg) -> None:
            info = InstanceInfo.model_validate_json(msg.data)
            if info.instance_id == name and info.leader:
                led.set()

        nc = await nats.connect(self.t.nats_urls())
        try:
            await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
            async with asyncio.timeout(timeout_s):
                while not led.is_set():
                    if dead := self._dead_child():
                        raise RuntimeError(f"{dead.name} exited before it led")
                    await asyncio.sleep(0.25)
        finally:
            await nc.close()

    async def _http_ready(self) -> bool:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                for url in self.t.gateway_urls():
                    async with http.get(f"{url}/health") as resp:
                        if resp.status != 200:
                            return False
        except (TimeoutError, aiohttp.ClientError):
            return False
        return True

    async def supervise(self, now: float) -> None:
        """As LocalCluster's, and a NATS node that died starts again on its host (same
        address and store): it rejoins the cluster and catches its streams up."""
        await super().supervise(now)
        for name, node in self.nodes.items():
            if node.proc is not None and node.proc.poll() is not None:
                log.error("NATS node on host %s exited; starting it again", name)
                try:
                    await asyncio.to_thread(node.start)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    log.warning("NATS node on host %s did not start (%s); trying again", name, exc)

    async def stop(self) -> None:
        await super().stop()
        for node in self.nodes.values():
            await asyncio.to_thread(node.stop)
        if self.relay is not None:
            await self.relay.stop()
        await asyncio.to_thread(self.net.destroy)
