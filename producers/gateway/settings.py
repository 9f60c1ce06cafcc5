"""The gateway's settings: one frozen object, parsed at the edge (``conveyor gateway``).

``GatewaySettings`` is a ``ClientSettings`` (the gateway is a client of the queue:
the same ``CONVEYOR_KAFKA_*`` and ``CONVEYOR_REDIS_*`` variables) plus the HTTP
server's own, each ``CONVEYOR_GATEWAY_<NAME>``.
"""

from __future__ import annotations

from pydantic import Field, FilePath, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from producers.settings import ClientSettings


class GatewaySettings(ClientSettings):
    """What one ``conveyor gateway`` process listens on, waits for and refuses."""

    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", frozen=True, extra="ignore", env_nested_delimiter="__"
    )

    source: str = Field(default="conveyor-gateway", min_length=1)
    """``ce_source`` of every request the gateway sends."""
    gateway_host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    gateway_port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on (0: any free port, printed at start)."""
    gateway_token: SecretStr | None = None
    """A bearer token every request but the health probes must carry
    (``Authorization: Bearer <token>``); none: no token is asked for."""
    gateway_tls_cert_file: FilePath | None = None
    """PEM certificate the gateway serves HTTPS with (with ``gateway_tls_key_file``)."""
    gateway_tls_key_file: FilePath | None = None
    """PEM private key of ``gateway_tls_cert_file``."""
    gateway_tls_ca_file: FilePath | None = None
    """PEM CA(s) whose client certificates are required (mTLS); needs the two above."""
    gateway_keep_alive_s: int = Field(default=75, ge=1, le=3600)
    """How long an idle keep-alive connection stays open: longer than the idle timeout
    of a load balancer in front (many close theirs at 60 s), so that it never sends a
    request on a connection the gateway is closing."""
    gateway_wait_s: float = Field(default=30.0, gt=0, le=3600)
    """How long a request waits for its answer when the caller gives no timeout."""
    gateway_max_wait_s: float = Field(default=300.0, gt=0, le=86_400)
    """The longest wait a caller's timeout may ask for."""
    gateway_max_lag: int | None = Field(default=10_000, ge=0)
    """Back-pressure: above this many records not yet committed by the model's consumer
    group (its lag on the request topic), requests get 429 with ``Retry-After`` rather
    than queueing; none: no limit."""
    gateway_lag_cache_s: float = Field(default=1.0, ge=0, le=60)
    """How long a model's lag, once read from Kafka, is taken as current."""
    gateway_retry_after_s: int = Field(default=1, ge=1, le=3600)
    """The ``Retry-After`` of a 429."""
    gateway_claim_ttl_s: int = Field(default=86_400, ge=1)
    """How long a request id stays claimed by the first gateway request that sent it
    (``conveyor:gateway:claim:<id>``): a retry within it never sends it again. Keep it
    at least the workers' result TTL."""
    gateway_max_batch: int = Field(default=256, ge=1, le=65_536)
    """The most requests one infer call may carry (an input of shape [N])."""

    @model_validator(mode="after")
    def _check_gateway(self) -> GatewaySettings:
        if (self.gateway_tls_cert_file is None) != (self.gateway_tls_key_file is None):
            raise ValueError("gateway_tls_cert_file and gateway_tls_key_file go together")
        if self.gateway_tls_ca_file is not None and self.gateway_tls_cert_file is None:
            raise ValueError(
                "gateway_tls_ca_file (client certificates) needs gateway_tls_cert_file "
                "and gateway_tls_key_file: mTLS is TLS first"
            )
        if self.redis_cluster:
            raise ValueError(
                "the gateway needs a standalone Redis (its claims and the models' "
                "descriptions are not routed on a Redis Cluster): leave redis_cluster off"
            )
        return self
