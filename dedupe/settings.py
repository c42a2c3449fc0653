"""Configuration, validated once at the edge: CLI options override DEDUPE_* variables."""

from __future__ import annotations

import os
import socket
from typing import Any

import pydantic
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dedupe.errors import unknown_option
from dedupe.registry import installed_schemes, scheme_of

DEFAULT_DATABASE_URL = "postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe"
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"


# AMQP's basic.qos counts in 16 bits; Kafka's batch is one claim statement, kept to that too.
PREFETCH_MAX = 65_535


class Settings(BaseSettings):
    """Every option of `dedupe-worker`; each reads DEDUPE_<NAME> from the environment."""

    model_config = SettingsConfigDict(env_prefix="DEDUPE_", frozen=True, extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = DEFAULT_BROKER_URL
    concurrency: int = Field(32, ge=1, le=10_000)
    prefetch: int | None = Field(None, ge=1, le=PREFETCH_MAX)
    shutdown_timeout_s: float = Field(30.0, ge=0)
    connect_timeout_s: float = Field(60.0, ge=0)
    gc_interval_s: float = Field(300.0, ge=0)
    park_after_s: float = Field(5.0, ge=0)
    stats_interval_s: float = Field(10.0, ge=0)
    worker_name: str = Field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    log_level: str = "INFO"
    receiver_host: str = "127.0.0.1"
    receiver_port: int = Field(8080, ge=1, le=65_535)
    log_format: str = "text"
    event_loop: str = "auto"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(0, ge=0, le=65_535)
    metrics_interval_s: float = Field(15.0, gt=0)
    status_host: str = "127.0.0.1"
    status_port: int = Field(8081, ge=1, le=65_535)
    status_token: SecretStr | None = None

    def __init__(self, **values: Any) -> None:
        # A keyword argument no field has is a typo, never ignored (`extra="ignore"` is for
        # the environment: DEDUPE_* variables of the commands' own options, or of other tools).
        for name in values:
            if name not in type(self).model_fields and not name.startswith("_"):
                raise unknown_option("Settings", name, type(self).model_fields)
        super().__init__(**values)

    @field_validator("log_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        value = value.lower()
        if value not in {"text", "json"}:
            raise ValueError("use text or json")
        return value

    @field_validator("event_loop")
    @classmethod
    def _known_loop(cls, value: str) -> str:
        value = value.lower()
        if value not in {"auto", "uvloop", "asyncio"}:
            raise ValueError("use auto (uvloop when installed), uvloop or asyncio")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        value = value.upper()
        if value not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("use DEBUG, INFO, WARNING or ERROR")
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("expected postgresql://user:password@host:port/database")
        return value

    @field_validator("broker_url")
    @classmethod
    def _known_broker(cls, value: str) -> str:
        # Any scheme an installed transport registers (dedupe.registry), a third party's too.
        scheme, installed = scheme_of(value), installed_schemes()
        if not scheme:
            raise ValueError(
                "expected a broker URL such as amqp://user:pass@host:port/vhost (RabbitMQ) or "
                "kafka://host:port (Kafka)"
            )
        if scheme not in installed:
            known = ", ".join(f"{name}://" for name in installed) or "none"
            raise ValueError(f"no transport is installed for {scheme}:// URLs (installed: {known})")
        return value

    @property
    def effective_prefetch(self) -> int:
        """The prefetch, or 8 x concurrency: a batch's claim and completion commits hold its
        deliveries unacknowledged, so the window must cover several batches' worth of work
        in flight for the rate not to be bound by it (BENCHMARKS.md, "The prefetch")."""
        return self.prefetch or min(self.concurrency * 8, PREFETCH_MAX)


def invalid_settings(exc: pydantic.ValidationError) -> str:
    """What pydantic refused, one `field: why` per problem, for an error message."""
    problems = "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
    )
    return f"invalid configuration: {problems}"
