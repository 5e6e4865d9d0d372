"""The console's settings, read from the environment (`halfmoon serve console` and
`halfmoon up` set them), and who may see it: beyond loopback only holders of the admin key."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from shared.db.session import default_url

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
DEFAULT_REFRESH_S = 3.0


@dataclass(frozen=True)
class ConsoleSettings:
    database_url: str
    gateway_url: str
    refresh_s: float
    # For the gateway's /admin/* when API keys are on, and what a visitor must type when
    # the console listens beyond loopback (`host`).
    admin_key: str = ""
    host: str = "127.0.0.1"

    @classmethod
    def from_env(cls) -> ConsoleSettings:
        try:
            refresh = float(os.environ.get("HALFMOON_CONSOLE_REFRESH_S") or DEFAULT_REFRESH_S)
        except ValueError:
            refresh = DEFAULT_REFRESH_S
        return cls(
            database_url=os.environ.get("HALFMOON_DATABASE_URL") or default_url(),
            gateway_url=os.environ.get("HALFMOON_GATEWAY_URL") or DEFAULT_GATEWAY_URL,
            refresh_s=max(refresh, 0.5),
            admin_key=admin_key_from_env(),
            host=os.environ.get("HALFMOON_CONSOLE_HOST") or "127.0.0.1",
        )

    @property
    def needs_login(self) -> bool:
        return not is_loopback(self.host)


def admin_key_from_env() -> str:
    """HALFMOON_ADMIN_KEY, else the first line of HALFMOON_ADMIN_KEY_FILE ("" if neither;
    an unreadable file counts as none, and the console then refuses visitors)."""
    key = os.environ.get("HALFMOON_ADMIN_KEY", "")
    path = os.environ.get("HALFMOON_ADMIN_KEY_FILE", "")
    if key or not path:
        return key
    try:
        return Path(path).expanduser().read_text().strip()
    except OSError:
        return ""


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host`. "" and 0.0.0.0 mean every interface: not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that resolves elsewhere
