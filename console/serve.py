"""`halfmoon serve console`: run the Streamlit app as a child process.

Streamlit owns its own server loop and signal handling, so the console is a subprocess
rather than an import; this wrapper maps Halfmoon flags and env vars onto Streamlit's
and passes SIGTERM/SIGINT through so that `halfmoon up` can stop it like any service.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

from console.settings import admin_key_from_env, is_loopback

APP = Path(__file__).resolve().parent / "app.py"
ROOT = APP.parents[1]
# Console settings the app reads from the environment: flag name -> env var.
_APP_ENV = {
    "database_url": "HALFMOON_DATABASE_URL",
    "gateway_url": "HALFMOON_GATEWAY_URL",
    "refresh_s": "HALFMOON_CONSOLE_REFRESH_S",
}


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="halfmoon serve console",
        description="Halfmoon operations console (Streamlit). Unknown flags go to streamlit.",
    )
    p.add_argument(
        "--host",
        default=env("HALFMOON_CONSOLE_HOST") or "127.0.0.1",
        help="address to listen on [env HALFMOON_CONSOLE_HOST; default 127.0.0.1]",
    )
    # A string default goes through type=int too, so a bad env value is a usage error.
    p.add_argument(
        "--port",
        type=int,
        default=env("HALFMOON_CONSOLE_PORT") or "8501",
        help="port [env HALFMOON_CONSOLE_PORT; default 8501]",
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL [env HALFMOON_DATABASE_URL; default SQLite in HALFMOON_HOME]",
    )
    p.add_argument(
        "--gateway-url",
        default=None,
        help="gateway base URL [env HALFMOON_GATEWAY_URL; default http://127.0.0.1:8000]",
    )
    p.add_argument(
        "--refresh-s",
        default=None,
        help="seconds between refreshes [env HALFMOON_CONSOLE_REFRESH_S; default 3]",
    )
    return p


def command(host: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        host,
        "--browser.gatherUsageStats",
        "false",
        *extra,
    ]


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for name, var in _APP_ENV.items():
        if getattr(args, name) is not None:
            env[var] = str(getattr(args, name))
    # The app imports `console` and `shared`; make that work from a plain checkout too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not is_loopback(args.host) and not admin_key_from_env():
        # Beyond loopback the app asks visitors for the admin key; without one to check
        # against it could only turn everyone away, so say why now.
        parser.error(
            f"--host {args.host} is reachable from other machines: set "
            "HALFMOON_ADMIN_KEY or HALFMOON_ADMIN_KEY_FILE (visitors must type that "
            "key), or listen on 127.0.0.1"
        )
    env = child_env(args)
    env["HALFMOON_CONSOLE_HOST"] = args.host  # the app asks for the key beyond loopback
    child = subprocess.Popen(command(args.host, args.port, extra), env=env)

    def forward(signum: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    # Handlers can only be set from the main thread; elsewhere the child gets signals itself.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {
        sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT) if in_main
    }
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # A child killed by a signal reports -N; shells and supervisors expect 128 + N.
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    raise SystemExit(main())
