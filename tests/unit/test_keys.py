"""API keys: minting, hashing at rest, the SQL key store with its cache, the migration,
and the per-key rate limiter (real SQLite; PostgreSQL too when configured)."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from sqlalchemy import inspect, text

from services.gateway import keys
from services.gateway.args import GatewaySettings, parse_args
from services.gateway.auth import area_of
from services.gateway.keys import ApiKey, KeyStore
from services.gateway.ratelimit import KeyLimiter
from shared.db import session as db


def test_secrets_are_random_and_hashed_with_sha256():
    a, b = keys.new_secret(), keys.new_secret()
    assert a != b and a.startswith("hm-") and len(a) >= 40  # 256 random bits, urlsafe
    assert keys.hash_key(a) == hashlib.sha256(a.encode()).hexdigest() != keys.hash_key(b)


def test_key_specs_from_settings():
    specs = keys.parse_key_specs(" acme:k-one:5/second;100/day , beta:k-two ,")
    assert specs[keys.hash_key("k-one")] == ApiKey("env-1", "acme", False, "5/second;100/day")
    assert specs[keys.hash_key("k-two")] == ApiKey("env-2", "beta", False, "")
    assert "k-one" not in repr(specs)  # only digests are kept
    for bad in ("acme", "acme:", ":k", "acme:k:often"):
        with pytest.raises(ValueError):
            keys.parse_key_specs(bad)


def test_a_bad_key_setting_never_echoes_the_secret(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--api-keys", "acme:sup3r-secret:often"])
    err = capsys.readouterr().err
    assert "api_keys" in err and "sup3r-secret" not in err


def test_keys_are_off_by_default_and_on_when_any_key_is_given():
    assert not GatewaySettings().keys_enabled()
    assert GatewaySettings(require_api_key=True).keys_enabled()
    assert GatewaySettings(api_keys="a:k").keys_enabled()
    assert GatewaySettings(admin_key="k").keys_enabled()


def test_routes_fall_in_areas():
    assert [
        area_of(p)
        for p in (
            "/v1/chat/completions",
            "/v1/models",
            "/admin/kv",
            "/admin/requests/x",
            "/health",
            "/openapi.json",
            "/v1x",
        )
    ] == ["api", "api", "admin", "admin", "public", "public", "public"]


async def test_sql_store_keeps_only_digests_and_honours_revocation(db_url):
    engine = db.make_engine(db_url)
    try:
        secret, row = await keys.create_key(engine, "acme", name="ci", rate_limit="9/minute")
        admin_secret, _ = await keys.create_key(engine, "ops", admin=True)
        async with engine.connect() as conn:
            dump = repr((await conn.execute(text("SELECT * FROM api_keys"))).all())
        assert secret not in dump and admin_secret not in dump
        assert keys.hash_key(secret) in dump and row.prefix == secret[:10]

        store = KeyStore(engine, {}, cache_ttl_s=0.0)
        assert await store.lookup(secret) == ApiKey(row.id, "acme", False, "9/minute")
        assert (await store.lookup(admin_secret)).admin is True
        assert await store.lookup(secret + "x") is None
        assert [r.id for r in await keys.list_keys(engine)] == [row.id, _.id]

        cached = KeyStore(engine, {}, cache_ttl_s=60.0)
        assert await cached.lookup(secret) is not None
        assert await keys.revoke_key(engine, row.id) is True
        assert await keys.revoke_key(engine, row.id) is False  # already revoked
        assert await store.lookup(secret) is None  # no cache: refused at once
        assert await cached.lookup(secret) is not None  # until the cache entry expires
        assert [r.id for r in await keys.list_keys(engine)] == [_.id]
        assert len(await keys.list_keys(engine, include_revoked=True)) == 2
    finally:
        await engine.dispose()


async def test_static_keys_need_no_sql():
    static = keys.parse_key_specs("acme:k1")
    store = KeyStore(None, static)
    assert (await store.lookup("k1")).tenant == "acme"
    assert await store.lookup("k2") is None


async def test_sql_misses_are_cached_and_the_cache_is_bounded(db_url):
    engine = db.make_engine(db_url)
    try:
        store = KeyStore(engine, {}, cache_ttl_s=60.0, cache_size=3)
        for i in range(5):
            assert await store.lookup(f"nope-{i}") is None
        assert len(store._cache) == 3
    finally:
        await engine.dispose()


async def test_migration_0005_adds_and_drops_the_table(db_url):
    async def tables() -> set[str]:
        engine = db.make_engine(db_url)
        try:
            async with engine.connect() as conn:
                return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
        finally:
            await engine.dispose()

    assert "api_keys" in await tables()
    await asyncio.to_thread(db.downgrade, db_url, "0004")
    assert "api_keys" not in await tables() and "requests" in await tables()
    await db.upgrade_async(db_url)
    assert "api_keys" in await tables()


async def test_limiter_refuses_past_the_limit_with_the_wait():
    limiter = KeyLimiter()
    assert [await limiter.hit("a", "3/minute") for _ in range(3)] == [None] * 3
    wait = await limiter.hit("a", "3/minute")
    assert wait is not None and 55 < wait <= 60
    assert await limiter.hit("b", "3/minute") is None  # per key
    assert all([await limiter.hit("c") is None for _ in range(50)])  # no limit, no default


async def test_limiter_default_applies_to_keys_without_their_own():
    limiter = KeyLimiter("2/minute")
    assert [await limiter.hit("a") for _ in range(2)] == [None, None]
    assert await limiter.hit("a") is not None
    assert await limiter.hit("b", "5/minute") is None  # its own limit wins


async def test_a_refused_request_uses_up_no_other_window():
    limiter = KeyLimiter()
    rate = "2/second;3/minute"
    assert await limiter.hit("a", rate) is None and await limiter.hit("a", rate) is None
    wait = await limiter.hit("a", rate)  # refused by the per-second window...
    assert wait is not None and wait <= 1.0
    # Asked again until that window moves on: refused asks charge nothing, so the minute
    # window still has room (had any of them been charged, it would refuse for a minute).
    deadline = time.monotonic() + 30
    while (wait := await limiter.hit("a", rate)) is not None:
        assert wait <= 1.0 and time.monotonic() < deadline, wait
        await asyncio.sleep(min(wait, 0.05))
    wait = await limiter.hit("a", rate)
    assert wait is not None and wait > 50  # now the minute window is full


def test_limits_reject_bad_syntax():
    with pytest.raises(ValueError):
        GatewaySettings(default_rate_limit="lots")
    assert keys.parse_rate_limit("") == []
    assert len(keys.parse_rate_limit("5/second;100/day")) == 2
