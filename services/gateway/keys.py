"""API keys: minting, hashing, and where the gateway finds them (settings and SQL).

A key is 256 random bits; only its SHA-256 is stored or held in memory. A slow
password hash (bcrypt, argon2) buys nothing for secrets with that much entropy and
would cost every request, so a plain digest is the usual choice for API keys.

Each key names a tenant (the prefix-cache salt: tenants never share cached blocks) and
an optional rate limit in `limits` syntax ("60/minute", "10/second;1000/day").
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import limits
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.db.schema import ApiKeyRecord
from shared.db.session import sessionmaker

KEY_PREFIX = "hm-"
MAX_TENANT_LEN = 200


@dataclass(frozen=True)
class ApiKey:
    """What a valid key grants: never the secret itself."""

    id: str
    tenant: str
    admin: bool = False
    rate_limit: str = ""  # `limits` syntax; "": the gateway's default


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_key_file(path: str) -> str:
    """The one key in `path` (surrounding whitespace ignored); ValueError says what is wrong
    without echoing anything the file holds."""
    try:
        secret = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    if not secret or any(c.isspace() for c in secret):
        raise ValueError(f"the key file {path} must hold exactly one key")
    return secret


def create_key_file(path: str) -> str | None:
    """A new key written to `path` (created 0600, never overwritten); None if the file is
    there already: a key is made once, on first start, and kept."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None
    secret = new_secret()
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_rate_limit(text: str) -> list[limits.RateLimitItem]:
    """ "" -> no limit; otherwise `limits` syntax, several joined by ';' (ValueError if bad)."""
    text = text.strip()
    return limits.parse_many(text) if text else []


def check_tenant(tenant: str) -> str:
    tenant = tenant.strip()
    if not tenant or len(tenant) > MAX_TENANT_LEN or any(c in tenant for c in ":,\n"):
        raise ValueError(
            f"tenant must be 1-{MAX_TENANT_LEN} characters without ':', ',' "
            f"or newlines, got {tenant!r}"
        )
    return tenant


def parse_key_specs(text: str) -> dict[str, ApiKey]:
    """HALFMOON_API_KEYS: "TENANT:KEY[:RATE],..." -> {sha256: ApiKey}. The error names the
    entry by position, never by its secret."""
    out: dict[str, ApiKey] = {}
    for i, entry in enumerate(e.strip() for e in text.split(",")):
        if not entry:
            continue
        parts = entry.split(":", 2)
        if len(parts) < 2 or not parts[1]:
            raise ValueError(f"api key entry {i + 1}: expected TENANT:KEY[:RATE]")
        tenant, secret = check_tenant(parts[0]), parts[1]
        rate = parts[2] if len(parts) == 3 else ""
        try:
            parse_rate_limit(rate)
        except ValueError:
            raise ValueError(f"api key entry {i + 1}: bad rate limit {rate!r}") from None
        digest = hash_key(secret)
        out[digest] = ApiKey(id=f"env-{i + 1}", tenant=tenant, rate_limit=rate)
    return out


# -- SQL ------------------------------------------------------------------------------
async def create_key(
    engine: AsyncEngine, tenant: str, *, name: str = "", admin: bool = False, rate_limit: str = ""
) -> tuple[str, ApiKeyRecord]:
    """Store a new key; returns (the secret, shown this once, and its row)."""
    tenant = check_tenant(tenant)
    parse_rate_limit(rate_limit)
    secret = new_secret()
    row = ApiKeyRecord(
        id=f"key_{uuid.uuid4().hex[:16]}",
        key_hash=hash_key(secret),
        prefix=secret[:10],
        name=name,
        tenant=tenant,
        admin=admin,
        rate_limit=rate_limit.strip(),
        created=time.time(),
        revoked=None,
    )
    async with sessionmaker(engine)() as s:
        s.add(row)
        await s.commit()
    return secret, row


async def list_keys(engine: AsyncEngine, include_revoked: bool = False) -> list[ApiKeyRecord]:
    stmt = select(ApiKeyRecord).order_by(ApiKeyRecord.created)
    if not include_revoked:
        stmt = stmt.where(ApiKeyRecord.revoked.is_(None))
    async with sessionmaker(engine)() as s:
        return list((await s.execute(stmt)).scalars())


async def revoke_key(engine: AsyncEngine, key_id: str) -> bool:
    """True if a live key with that id was revoked."""
    async with sessionmaker(engine)() as s:
        result = await s.execute(
            update(ApiKeyRecord)
            .where(ApiKeyRecord.id == key_id, ApiKeyRecord.revoked.is_(None))
            .values(revoked=time.time())
        )
        await s.commit()
    return bool(result.rowcount)


async def find_key(engine: AsyncEngine, digest: str) -> ApiKey | None:
    async with sessionmaker(engine)() as s:
        row = (
            await s.execute(
                select(ApiKeyRecord).where(
                    ApiKeyRecord.key_hash == digest, ApiKeyRecord.revoked.is_(None)
                )
            )
        ).scalar_one_or_none()
    if row is None:
        return None
    return ApiKey(id=row.id, tenant=row.tenant, admin=row.admin, rate_limit=row.rate_limit)


class KeyStore:
    """Keys from settings (in memory) and SQL (looked up by digest, cached briefly).

    The cache keeps a hot key from costing a query per request; its TTL bounds how long
    a revoked key keeps working. Misses are cached too, so a client retrying a bad key
    does not hit SQL each time; the cache is bounded (oldest entries go first).
    """

    def __init__(
        self,
        engine: AsyncEngine | None,
        static: dict[str, ApiKey],
        cache_ttl_s: float = 5.0,
        cache_size: int = 4096,
    ) -> None:
        self.engine = engine
        self.static = static
        self.ttl = cache_ttl_s
        self.size = cache_size
        self._cache: OrderedDict[str, tuple[float, ApiKey | None]] = OrderedDict()

    async def lookup(self, secret: str) -> ApiKey | None:
        digest = hash_key(secret)
        if digest in self.static:
            return self.static[digest]
        if self.engine is None:
            return None
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        key = await find_key(self.engine, digest)
        self._cache[digest] = (now + self.ttl, key)
        self._cache.move_to_end(digest)
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return key
