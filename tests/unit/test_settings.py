import pytest
from pydantic import Field

from shared.settings import BaseSettings, build_parser, parse_settings


class DemoSettings(BaseSettings):
    port: int = Field(8000, description="port")
    verbose: bool = Field(False, description="chatty")


def test_flag_beats_env_beats_default(monkeypatch):
    assert parse_settings(DemoSettings, [], "demo").port == 8000
    monkeypatch.setenv("HALFMOON_PORT", "9000")
    assert parse_settings(DemoSettings, [], "demo").port == 9000
    assert parse_settings(DemoSettings, ["--port", "9100"], "demo").port == 9100


def test_bool_flags_and_env(monkeypatch):
    assert parse_settings(DemoSettings, ["--verbose"], "demo").verbose is True
    monkeypatch.setenv("HALFMOON_VERBOSE", "true")
    assert parse_settings(DemoSettings, [], "demo").verbose is True
    assert parse_settings(DemoSettings, ["--no-verbose"], "demo").verbose is False


def test_help_names_env_vars():
    text = build_parser(DemoSettings, "demo").format_help()
    assert "HALFMOON_PORT" in text and "HALFMOON_NATS_URL" in text


def test_bad_value_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        parse_settings(DemoSettings, ["--port", "eighty"], "demo")
    assert "port" in capsys.readouterr().err


def test_errors_keep_their_kind_across_the_bus():
    from shared import bus, errors

    raw = bus.encode_error(errors.Rejected("slo", code="slo_unattainable", retry_after_s=3))
    with pytest.raises(errors.Rejected) as info:
        bus.decode_reply(raw, BaseSettings)
    assert info.value.status == 429 and info.value.code == "slo_unattainable"
    assert info.value.retry_after_s == 3
