"""Settings: every field is both a command-line flag and a HALFMOON_ env var.

A service declares a pydantic model; `parse_settings` turns each field into
`--field-name` (help text shows the env var and default) and reads
`HALFMOON_FIELD_NAME` as the default. Precedence: flag > env var > field default.
Pydantic then validates the lot, so a bad value fails at start with a clear message.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.model_context import parse_rope_scaling

ENV_PREFIX = "HALFMOON_"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Any pydantic model: the tools' settings (bench, chaos, up) are not BaseSettings.
S = TypeVar("S", bound=BaseModel)


def halfmoon_home() -> Path:
    """Where models, the SQLite database, NATS state and logs live by default."""
    return Path(os.environ.get("HALFMOON_HOME") or Path.home() / ".halfmoon").expanduser()


class BaseSettings(BaseModel):
    """Settings every process shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nats_url: str = Field(
        "nats://127.0.0.1:4222", description="NATS server URL(s), comma separated"
    )
    nats_user: str = Field("", description="NATS user (empty: no auth)")
    nats_password: str = Field("", description="NATS password")
    # Control-plane security (see docs/deploy.md, "Security"): KV transfer ids, prompts and
    # tokens ride NATS, so on a network it wants credentials and TLS.
    nats_creds: str = Field(
        "",
        description="NATS credentials file (user JWT + NKey seed, as "
        "`nsc` writes it; needs `pip install nkeys`; empty: none)",
    )
    nats_tls_ca: str = Field(
        "",
        description="CA bundle the NATS servers' certificates chain "
        "to; setting it (or any nats_tls_* field, or a tls:// URL) turns "
        "TLS on (empty: the system's CAs)",
    )
    nats_tls_cert: str = Field(
        "",
        description="client certificate, for NATS servers that "
        "verify clients (tls { verify: true })",
    )
    nats_tls_key: str = Field("", description="private key of nats_tls_cert")
    nats_tls_hostname: str = Field(
        "",
        description="name the NATS servers' certificates are "
        "checked against (empty: each URL's host)",
    )
    log_level: str = Field("INFO", description="logging level")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    # Prometheus /metrics for services without an HTTP API; the gateway always serves it on
    # its own port too. A port already taken is logged and the service runs on unobserved.
    metrics_port: int = Field(
        0, ge=0, le=65535, description="serve Prometheus GET /metrics on this port (0: off)"
    )
    metrics_host: str = Field("127.0.0.1", description="address the /metrics server binds")

    @model_validator(mode="after")
    def _nats_files(self) -> BaseSettings:
        """A mistyped path fails at start, naming the setting, not at the first reconnect."""
        if self.nats_tls_key and not self.nats_tls_cert:
            raise ValueError("nats_tls_key is set without nats_tls_cert")
        for name in ("nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"{name}: no such file: {path}")
        return self


class ContextSettings(BaseModel):
    """The served context, set alike on the gateway and every engine (`halfmoon up` passes
    its own to each); shared/model_context.py holds the rule."""

    max_model_len: int = Field(
        0, ge=0, description="longest prompt + output served (0: the model's, as stretched)"
    )
    rope_scaling: str = Field(
        "",
        description="stretch the model's rotary positions: TYPE:FACTOR (linear, yarn, "
        'llama3, dynamic; e.g. yarn:4) or a JSON object such as {"rope_type": "yarn", '
        '"factor": 4, "original_max_position_embeddings": 8192} (empty: as it ships)',
    )

    @field_validator("rope_scaling")
    @classmethod
    def _parses(cls, v: str) -> str:
        parse_rope_scaling(v)  # a bad value fails at start, naming the setting
        return v


class DatabaseSettings(BaseModel):
    database_url: str = Field(
        "", description="SQLAlchemy async URL (empty: SQLite in HALFMOON_HOME)"
    )


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    return get_args(annotation) if get_origin(annotation) is Literal else None


def build_parser(cls: type[BaseModel], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, info in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.default
        help_text = f"{info.description or name} [env {env_name(name)}; default {default!r}]"
        if _is_bool(info.annotation):
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag, dest=name, default=None, help=help_text, choices=_choices(info.annotation)
            )
    return parser


def settings_from(
    cls: type[S],
    namespace: argparse.Namespace | None = None,
    overrides: dict[str, Any] | None = None,
) -> S:
    """Resolve flag > env > default and validate."""
    values: dict[str, Any] = {}
    for name in cls.model_fields:
        raw = getattr(namespace, name, None) if namespace is not None else None
        if raw is None:
            raw = os.environ.get(env_name(name))
        if raw is not None:
            values[name] = raw
    values.update(overrides or {})
    return cls.model_validate(values)


def parse_settings(cls: type[S], argv: Sequence[str] | None, prog: str, description: str = "") -> S:
    parser = build_parser(cls, prog, description)
    ns = parser.parse_args(argv)
    try:
        return settings_from(cls, ns)
    except ValidationError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
