"""The admin key compose makes on first start: `halfmoon keys init-admin` writes it once
(0600, printed once), the gateway reads it from --admin-key-file, and the console asks
visitors for it when it listens beyond loopback."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from pydantic import ValidationError
from streamlit.testing.v1 import AppTest

from console import serve
from console.settings import is_loopback
from services.gateway.args import GatewaySettings
from services.gateway.auth import Auth
from services.gateway.keys_cli import main as keys_main

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "console" / "app.py")
UNREACHABLE_GATEWAY = "http://127.0.0.1:9"


def test_init_admin_makes_the_key_once_and_prints_it_once(tmp_path, capsys):
    path = tmp_path / "secrets" / "admin_key"
    assert keys_main(["init-admin", "--file", str(path)]) == 0
    first = capsys.readouterr().out
    secret = path.read_text().strip()
    assert secret.startswith("hm-") and secret in first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys_main(["init-admin", "--file", str(path)]) == 0  # the next start
    again = capsys.readouterr().out
    assert secret not in again and "kept in" in again
    assert path.read_text().strip() == secret  # never replaced


def test_init_admin_refuses_a_broken_key_file(tmp_path, capsys):
    path = tmp_path / "admin_key"
    path.write_text("")
    assert keys_main(["init-admin", "--file", str(path)]) == 1
    assert "exactly one key" in capsys.readouterr().err


async def test_the_gateway_takes_its_admin_key_from_the_file(tmp_path):
    path = tmp_path / "admin_key"
    path.write_text("hm-the-admin-key\n")
    settings = GatewaySettings(admin_key_file=str(path))
    assert settings.keys_enabled()  # a key file alone turns checking on
    auth = Auth.from_settings(settings, None)
    key = await auth.store.lookup("hm-the-admin-key")
    assert key is not None and key.admin
    assert await auth.store.lookup("hm-a-guess") is None
    with pytest.raises(ValidationError, match="cannot read the key file") as err:
        GatewaySettings(admin_key_file=str(tmp_path / "missing"))
    assert "hm-" not in str(err.value)


def test_loopback_is_only_this_machine():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.5", "console"))


@pytest.fixture
def wide_console(monkeypatch, tmp_path):
    """A console listening on every interface, with the admin key in a file."""
    path = tmp_path / "admin_key"
    path.write_text("hm-console-door\n")
    url = f"sqlite+aiosqlite:///{tmp_path / 'none.db'}"
    monkeypatch.setenv("HALFMOON_DATABASE_URL", url)
    monkeypatch.setenv("HALFMOON_GATEWAY_URL", UNREACHABLE_GATEWAY)
    monkeypatch.setenv("HALFMOON_CONSOLE_HOST", "0.0.0.0")
    monkeypatch.setenv("HALFMOON_ADMIN_KEY_FILE", str(path))
    monkeypatch.delenv("HALFMOON_ADMIN_KEY", raising=False)


def test_a_console_beyond_loopback_shows_nothing_without_the_admin_key(wide_console):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert not at.tabs and not at.metric and len(at.text_input) == 1
    at.text_input(key="login_key").input("hm-a-guess").run()
    assert not at.tabs and at.error[0].value == "That is not the admin key."
    at.text_input(key="login_key").input("hm-console-door").run()
    assert not at.exception
    assert [t.label for t in at.tabs][:2] == ["Overview", "Pools"]  # in, for this session


def test_a_console_beyond_loopback_without_a_key_turns_everyone_away(wide_console, monkeypatch):
    monkeypatch.delenv("HALFMOON_ADMIN_KEY_FILE")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.tabs and not at.text_input
    assert "no admin key" in at.error[0].value


def test_a_console_on_loopback_asks_for_nothing(wide_console, monkeypatch):
    monkeypatch.setenv("HALFMOON_CONSOLE_HOST", "127.0.0.1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not any(t.key == "login_key" for t in at.text_input)
    assert [t.label for t in at.tabs][:1] == ["Overview"]


def test_serve_console_beyond_loopback_needs_a_key(monkeypatch, capsys):
    for name in ("HALFMOON_ADMIN_KEY", "HALFMOON_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--host", "0.0.0.0", "--port", "1"])  # refused before streamlit starts
    assert exit_.value.code == 2 and "HALFMOON_ADMIN_KEY" in capsys.readouterr().err
