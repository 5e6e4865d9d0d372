"""The multi-host harness's pure parts: the layout, the names, the relayed URL, the flags."""

from __future__ import annotations

import pytest

from services.tools.hosts.relay import loopback_port, via
from services.tools.hosts.settings import HostsSettings
from services.tools.hosts.topology import four_hosts
from shared.natsd import EmbeddedNats
from shared.settings import settings_from


def test_four_hosts_layout_and_addresses() -> None:
    t = four_hosts("ab12cd", "10.213.7.0/24")
    assert [h.address for h in t.hosts] == [f"10.213.7.{i}" for i in (11, 12, 13, 14)]
    assert t.bridge_address == "10.213.7.1"
    assert [h.name for h in t.with_role("gateway")] == ["a", "b"]
    assert [h.name for h in t.with_role("conductor")] == ["a", "b"]
    assert [h.name for h in t.with_role("nats")] == ["a", "b", "c"]
    assert t.host("c").runs("prefill") and t.host("d").runs("decode")
    assert t.gateway_urls() == ["http://10.213.7.11:8000", "http://10.213.7.12:8000"]


def test_interface_names_fit_linux_limit() -> None:
    t = four_hosts("zzzzzz", "10.0.0.0/24")
    names = [t.bridge] + [n for h in t.hosts for n in (t.veth(h), t.peer(h))]
    assert all(len(n) <= 15 for n in names), names
    assert len(set(names)) == len(names)


def test_nats_routes_name_every_other_node() -> None:
    t = four_hosts("r1", "10.213.0.0/24")
    routes = t.nats_routes(t.host("b"))
    assert routes == ("nats://10.213.0.11:6222", "nats://10.213.0.13:6222")
    assert len(t.nats_urls()) == 3


@pytest.mark.parametrize("run_id", ["toolong7", "a-b", ""])
def test_bad_run_ids_are_refused(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        four_hosts(run_id, "10.213.0.0/24")


def test_a_subnet_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        four_hosts("r1", "10.213.0.0/29")


def test_unknown_host_is_named() -> None:
    with pytest.raises(KeyError, match="no host 'e'"):
        four_hosts("r1", "10.213.0.0/24").host("e")


def test_database_on_loopback_is_relayed_with_credentials_kept() -> None:
    url = "postgresql+asyncpg://postgres:pw@127.0.0.1:5432/test"
    assert loopback_port(url) == 5432
    assert via(url, "10.213.0.1", 40000) == "postgresql+asyncpg://postgres:pw@10.213.0.1:40000/test"
    assert loopback_port("postgresql+asyncpg://u@db.example:5432/x") == 0
    assert loopback_port("sqlite+aiosqlite:////tmp/x.db") == 0


def test_flags_the_layout_decides_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="console, colocated"):
        settings_from(HostsSettings, overrides={"console": True, "colocated": 2})
    s = settings_from(HostsSettings, overrides={})
    assert s.run_id and s.run_id.isalnum() and not s.console


def test_nats_cluster_node_config() -> None:
    node = EmbeddedNats(
        workdir=None,  # type: ignore[arg-type]  # config() does not touch it
        host="10.0.0.11",
        server_name="nats-a",
        cluster_name="halfmoon-x",
        routes=("nats://10.0.0.12:6222",),
    )
    conf = node.config()
    assert 'server_name: "nats-a"' in conf
    assert 'listen: "10.0.0.11:6222"' in conf
    assert 'routes: ["nats://10.0.0.12:6222"]' in conf
    assert "cluster" not in EmbeddedNats(workdir=None).config()  # type: ignore[arg-type]
