"""Where a client connects: one frozen settings object, parsed at the edge.

``ClientSettings()`` reads ``CONVEYOR_KAFKA_BOOTSTRAP``, ``CONVEYOR_REDIS_URL``,
``CONVEYOR_TOPIC_PREFIX`` and the credentials and TLS files of
``common.security.ConnectionSecurity`` (the variables a worker reads too) and
falls back to the loopback services that ``make up`` starts. Keyword arguments
win over the environment. Build it once, in ``main`` or the CLI, and pass it down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypedDict
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.redis_cluster import check_cluster_url
from common.s3 import S3Settings
from common.security import ConnectionSecurity, KafkaProtocol, SaslMechanism, redis_location
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
    send_linger_ms: int = Field(default=0, ge=0, le=1000)
    """How long the producer waits for more requests before sending a partition's batch:
    0 sends a lone ``submit`` at once (its ack p50 2.5 ms on a 2-vCPU VM, 9.0 ms lingering
    5 ms: ``bench.sdk_send --linger-ms``), and ``submit_many`` still fills its batches
    (its records are appended before the producer sends, and more gather while a request
    is in flight)."""
    redis_client_name: str | None = None
    """Redis ``CLIENT SETNAME`` of the client's connections, to find them in ``CLIENT LIST``."""
    redis_max_connections: int = Field(default=50, ge=1, le=10_000)
    """Most Redis connections the client opens for reads and writes (its pool); every
    wait shares one more, for notifications. A call that finds all of them busy waits
    for one, up to ``redis_pool_timeout_s``."""
    redis_pool_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """How long a call waits for a free connection of the pool before giving up
    with ``ConnectionsBusy``."""
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
    track_status: bool = False
    """Record each request sent (``sent_ms`` in ``conveyor:status:{<id>}``, kept
    ``status_ttl_s``), so that ``status`` and ``wait`` can tell a queued request from
    an id that was never sent. Mean it for every client of a deployment: a reader with
    it on calls an id no client recorded unknown. The workers' ``--track-status``
    reads the same variable."""
    status_ttl_s: int = Field(default=86_400, ge=1)
    """How long the record of a sent request is kept (a worker that starts it keeps
    it for the result TTL from then on)."""

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


class ClientOptions(TypedDict, total=False):
    """The fields of ``ClientSettings`` as keyword arguments of ``Client`` and ``AsyncClient``.

    Secrets and file paths may be plain strings; ``bootstrap`` is short for
    ``kafka_bootstrap``. ``tests/unit/test_client.py`` checks that this lists every field.
    """

    kafka_bootstrap: str
    redis_url: str | SecretStr
    redis_cluster: bool
    topic_prefix: str
    source: str
    connect_timeout_s: float
    send_timeout_s: float
    send_batch_bytes: int
    send_linger_ms: int
    redis_client_name: str | None
    redis_max_connections: int
    redis_pool_timeout_s: float
    limits: Limits
    dataref_store: Literal["redis", "s3", "off"]
    dataref_threshold_bytes: int
    dataref_ttl_s: int
    dataref_redis_prefix: str
    dataref_s3_bucket: str | None
    dataref_s3_prefix: str
    cancel_ttl_s: int
    track_status: bool
    status_ttl_s: int
    kafka_security_protocol: KafkaProtocol
    kafka_sasl_mechanism: SaslMechanism
    kafka_username: str | None
    kafka_password: str | SecretStr | None
    kafka_ca_file: str | Path | None
    kafka_cert_file: str | Path | None
    kafka_key_file: str | Path | None
    redis_username: str | None
    redis_password: str | SecretStr | None
    redis_ca_file: str | Path | None
    redis_cert_file: str | Path | None
    redis_key_file: str | Path | None
    s3_endpoint_url: str | None
    s3_region: str
    s3_access_key_id: str | None
    s3_secret_access_key: str | SecretStr | None
    s3_addressing_style: Literal["auto", "path", "virtual"]


def settings_from(
    caller: str, settings: ClientSettings | None, bootstrap: str | None, options: ClientOptions
) -> ClientSettings:
    """The settings a client constructor was given: ``settings`` as it is, or the keyword
    arguments over the environment (``ClientSettings(**options)``), never both.

    Raises ``TypeError`` for an unknown keyword (naming the valid ones) or for settings
    given twice, and pydantic's ``ValidationError`` for a bad value.
    """
    given: dict[str, Any] = dict(options)
    unknown = sorted(set(given) - set(ClientSettings.model_fields))
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        valid = ", ".join(["bootstrap", *sorted(ClientSettings.model_fields)])
        raise TypeError(f"{caller}() got unexpected keyword arguments {names}; valid are: {valid}")
    if bootstrap is not None:
        if "kafka_bootstrap" in given:
            raise TypeError(f"{caller}() got both bootstrap and kafka_bootstrap; give one")
        given["kafka_bootstrap"] = bootstrap
    if settings is None:
        return ClientSettings(**given)
    if not isinstance(settings, ClientSettings):
        raise TypeError(
            f"{caller}() takes a ClientSettings as its only positional argument, "
            f"not {type(settings).__name__}; give connection settings as keywords, "
            f'e.g. {caller}(bootstrap="127.0.0.1:9092", redis_url="redis://127.0.0.1:6379/0")'
        )
    if given:
        raise TypeError(
            f"{caller}() got a ClientSettings and keyword settings "
            f"({', '.join(sorted(given))}); give one or the other"
        )
    return settings
