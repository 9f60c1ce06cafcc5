"""Where a client connects: one frozen settings object, parsed at the edge.

``ClientSettings()`` reads ``CONVEYOR_KAFKA_BOOTSTRAP``, ``CONVEYOR_REDIS_URL``,
``CONVEYOR_TOPIC_PREFIX`` and the credentials and TLS files of
``common.security.ConnectionSecurity`` (the variables a worker reads too) and
falls back to the loopback services that ``make up`` starts. Keyword arguments
win over the environment. Build it once, in ``main`` or the CLI, and pass it down.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.redis_cluster import check_cluster_url
from common.s3 import S3Settings
from common.security import ConnectionSecurity, redis_location
from schemas import DEFAULT_DATA_PREFIX, DEFAULT_LIMITS, Limits, parse_dataref, topics_for

KiB = 1024
MiB = 1024 * KiB


class ClientSettings(BaseSettings, ConnectionSecurity, S3Settings):
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
    send_batch_bytes: int = Field(default=MiB, ge=1024, le=64 * MiB)
    """Most bytes of requests in one Kafka batch of a partition (the producer's
    ``max_batch_size``): with aiokafka's 16 KB default each larger image went alone,
    one per partition per round trip to the broker."""
    redis_client_name: str | None = None
    """Redis ``CLIENT SETNAME`` of the client's connections, to find them in ``CLIENT LIST``."""
    limits: Limits = DEFAULT_LIMITS
    """The limits requests are checked against before they are sent."""
    dataref_store: Literal["redis", "s3", "off"] = "redis"
    """Where payloads above ``dataref_threshold_bytes`` are stored, to be sent by
    reference (``ce_dataref``); ``off`` sends every payload in the record."""
    dataref_threshold_bytes: int = Field(default=768 * KiB, ge=1)
    """Payloads larger than this go by reference: below Kafka's default 1 MB record
    limit (``max.message.bytes``), with room for the headers."""
    dataref_ttl_s: int = Field(default=3600, ge=1)
    """How long a payload stored in Redis is kept (and what ``ce_dataexpires`` says;
    for S3, give the bucket a lifecycle rule that keeps objects at least this long)."""
    dataref_redis_prefix: str = Field(default=DEFAULT_DATA_PREFIX, min_length=1)
    """Payloads stored in Redis are keys ``<prefix><request id>``."""
    dataref_s3_bucket: str | None = None
    """The bucket payloads are stored in with ``dataref_store="s3"``."""
    dataref_s3_prefix: str = "conveyor/data/"
    """Payloads stored in S3 are objects ``<prefix><request id>``."""
    cancel_ttl_s: int = Field(default=86_400, ge=1)
    """How long a cancellation (``conveyor:cancel:{<id>}``) is kept."""

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

    @model_validator(mode="after")
    def _check_dataref_store(self) -> ClientSettings:
        if self.dataref_store == "s3":
            if self.dataref_s3_bucket is None:
                raise ValueError('dataref_store "s3" needs dataref_s3_bucket')
            parse_dataref(f"s3://{self.dataref_s3_bucket}/k")  # raises naming the rule
        return self

    @property
    def redis_location(self) -> str:
        """The Redis URL without its password, fit for error messages and logs."""
        return redis_location(self.redis_url)
