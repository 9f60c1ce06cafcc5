"""Where a client connects: one frozen settings object, parsed at the edge.

``ClientSettings()`` reads ``CONVEYOR_KAFKA_BOOTSTRAP``, ``CONVEYOR_REDIS_URL``,
``CONVEYOR_TOPIC_PREFIX`` and the credentials and TLS files of
``producers.security.ConnectionSecurity`` (the variables a worker reads too) and
falls back to the loopback services that ``make up`` starts. Keyword arguments
win over the environment. Build it once, in ``main`` or the CLI, and pass it down.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers.redis_cluster import check_cluster_url
from producers.security import ConnectionSecurity, redis_location
from schemas import DEFAULT_LIMITS, Limits, topics_for


class ClientSettings(BaseSettings, ConnectionSecurity):
    """Connection settings of a ``Client`` or ``AsyncClient``."""

    # extra="ignore": the worker's CONVEYOR_* variables may share this environment.
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", frozen=True, extra="ignore", env_nested_delimiter="__"
    )

    kafka_bootstrap: str = Field(default="127.0.0.1:9092", min_length=1)
    """Kafka bootstrap servers, ``host:port[,host:port...]``."""
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """Redis URL; may hold a password, so it is never printed (see ``redis_location``)."""
    redis_cluster: bool = False
    """``redis_url`` names a node of a Redis Cluster (the workers' ``redis_cluster`` too)."""
    topic_prefix: str = "conveyor"
    """Topics are ``<prefix>.<model>.requests``, ``.results`` and ``.dlq``."""
    source: str = Field(default="conveyor-sdk", min_length=1)
    """``ce_source`` of every request: who sent it, for tracing."""
    connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """How long to try to reach Kafka or Redis before giving up with ``ServiceUnavailable``."""
    send_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """How long the broker may take to acknowledge sent requests."""
    redis_client_name: str | None = None
    """Redis ``CLIENT SETNAME`` of the client's connections, to find them in ``CLIENT LIST``."""
    limits: Limits = DEFAULT_LIMITS
    """The limits requests are checked against before they are sent."""

    @field_validator("topic_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        topics_for("model", value)  # raises ValueError naming the bad prefix
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: SecretStr) -> SecretStr:
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"must be a redis://, rediss:// or unix:// URL, not {scheme!r}://")
        return value

    @model_validator(mode="after")
    def _check_redis_tls(self) -> ClientSettings:
        self.check_redis_url(self.redis_url)
        if self.redis_cluster:
            check_cluster_url(self.redis_url.get_secret_value())
        return self

    @property
    def redis_location(self) -> str:
        """The Redis URL without its password, fit for error messages and logs."""
        return redis_location(self.redis_url)
