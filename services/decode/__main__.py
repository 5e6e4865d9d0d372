"""`python -m services.decode` / `halfmoon serve decode`: an engine process that starts as
a decode instance (services/worker/serve.py; it may switch role in place)."""

from __future__ import annotations

from typing import Sequence

from services.worker.roles import EngineSettings
from services.worker.serve import serve
from shared.lifecycle import run_main
from shared.settings import parse_settings


def parse_args(argv: Sequence[str] | None = None) -> EngineSettings:
    settings = parse_settings(
        EngineSettings,
        argv,
        "halfmoon serve decode",
        "Decode instance: KV from prefill → remaining tokens, streamed.",
    )
    return settings.model_copy(update={"role": "decode"})


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    return run_main(lambda: serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
