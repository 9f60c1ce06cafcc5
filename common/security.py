"""How clients authenticate to Kafka and Redis and encrypt the traffic: settings and options.

``ConnectionSecurity`` holds the fields; ``ClientSettings`` and the worker's
``WorkerSettings`` both inherit them, so ``CONVEYOR_KAFKA_SECURITY_PROTOCOL`` and
friends mean the same thing to the SDK, the CLI and the worker. ``kafka_options``
and ``redis_options`` turn them into the keyword arguments of aiokafka's clients
and of ``redis.asyncio.Redis.from_url``; every place that builds a client uses them.

The defaults are plain connections with no credentials (the local services of
``make up``). Passwords are ``SecretStr``: they are read only where a client is
built and never appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from aiokafka.conn import create_conn
from aiokafka.helpers import create_ssl_context
from pydantic import BaseModel, ConfigDict, FilePath, SecretStr, model_validator


class ConnectFailed(ConnectionError):
    """Kafka or Redis could not be reached at start, or refused the TLS handshake or credentials.

    The message names the endpoint and the cause, never a secret.
    """


KafkaProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class ConnectionSecurity(BaseModel):
    """Credentials and TLS files for Kafka and Redis (a base of the settings classes)."""

    # Docstrings become the fields' descriptions (the worker's --help shows them), and a
    # validation error never echoes the input, which may hold a password.
    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    kafka_security_protocol: KafkaProtocol = "PLAINTEXT"
    """``SASL_SSL`` for a password over TLS; ``SSL`` for TLS (with a client certificate, if the
    broker asks for one); ``SASL_PLAINTEXT`` sends the password unencrypted."""
    kafka_sasl_mechanism: SaslMechanism = "PLAIN"
    """How the password is checked with a ``SASL_*`` protocol; ``SCRAM-*`` never sends it."""
    kafka_username: str | None = None
    """SASL user name; required with a ``SASL_*`` protocol."""
    kafka_password: SecretStr | None = None
    """SASL password; required with a ``SASL_*`` protocol."""
    kafka_ca_file: FilePath | None = None
    """PEM file of the CA(s) that signed the broker's certificate (default: the system's)."""
    kafka_cert_file: FilePath | None = None
    """PEM client certificate, for brokers that authenticate clients by certificate."""
    kafka_key_file: FilePath | None = None
    """PEM private key of ``kafka_cert_file``."""
    redis_username: str | None = None
    """Redis ACL user (default: the user in ``redis_url``, else ``default``)."""
    redis_password: SecretStr | None = None
    """Redis password (default: the password in ``redis_url``, if any)."""
    redis_ca_file: FilePath | None = None
    """PEM file of the CA(s) that signed Redis' certificate; needs a ``rediss://`` URL."""
    redis_cert_file: FilePath | None = None
    """PEM client certificate, for Redis servers that require one (``tls-auth-clients yes``)."""
    redis_key_file: FilePath | None = None
    """PEM private key of ``redis_cert_file``."""

    @model_validator(mode="after")
    def _check_security(self) -> ConnectionSecurity:
        protocol = self.kafka_security_protocol
        if protocol.startswith("SASL_") and not (self.kafka_username and self.kafka_password):
            raise ValueError(
                f"kafka_security_protocol {protocol} needs kafka_username and kafka_password"
            )
        tls_files = (self.kafka_ca_file, self.kafka_cert_file, self.kafka_key_file)
        if not protocol.endswith("SSL") and any(tls_files):
            raise ValueError(
                f"kafka_ca_file, kafka_cert_file and kafka_key_file need kafka_security_protocol "
                f"SSL or SASL_SSL, not {protocol}"
            )
        _check_pair("kafka", self.kafka_cert_file, self.kafka_key_file)
        _check_pair("redis", self.redis_cert_file, self.redis_key_file)
        return self

    def check_redis_url(self, redis_url: SecretStr) -> None:
        """Raise ``ValueError`` when Redis TLS files are given for a URL without TLS.

        (The settings classes own ``redis_url`` and call this from their validators.)
        """
        files = (self.redis_ca_file, self.redis_cert_file, self.redis_key_file)
        if any(files) and urlsplit(redis_url.get_secret_value()).scheme != "rediss":
            raise ValueError(
                "redis_ca_file, redis_cert_file and redis_key_file need a rediss:// redis_url"
            )

    @property
    def kafka_description(self) -> str:
        """How Kafka is reached, for messages: protocol, mechanism and user (no password)."""
        if not self.kafka_security_protocol.startswith("SASL_"):
            return self.kafka_security_protocol
        return (
            f"{self.kafka_security_protocol}, {self.kafka_sasl_mechanism} as {self.kafka_username}"
        )


def _check_pair(service: str, cert: Path | None, key: Path | None) -> None:
    if (cert is None) != (key is None):
        raise ValueError(f"{service}_cert_file and {service}_key_file go together: give both")


def kafka_options(security: ConnectionSecurity) -> dict[str, Any]:
    """Keyword arguments for ``AIOKafkaProducer``, ``AIOKafkaConsumer`` or ``AIOKafkaAdminClient``.

    Reads the TLS files (an SSL context is built here), so call it where the client
    is built, not at import time.
    """
    protocol = security.kafka_security_protocol
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol.endswith("SSL"):
        options["ssl_context"] = create_ssl_context(
            cafile=_text(security.kafka_ca_file),
            certfile=_text(security.kafka_cert_file),
            keyfile=_text(security.kafka_key_file),
        )
    if protocol.startswith("SASL_"):
        assert security.kafka_password is not None  # the validator requires it
        options["sasl_mechanism"] = security.kafka_sasl_mechanism
        options["sasl_plain_username"] = security.kafka_username
        options["sasl_plain_password"] = security.kafka_password.get_secret_value()
    return options


def redis_options(security: ConnectionSecurity) -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.Redis.from_url``, beside the URL.

    Only what is set is passed, so a user or password written in the URL still
    counts when the separate fields are empty.
    """
    options: dict[str, Any] = {}
    if security.redis_username is not None:
        options["username"] = security.redis_username
    if security.redis_password is not None:
        options["password"] = security.redis_password.get_secret_value()
    if security.redis_ca_file is not None:
        options["ssl_ca_certs"] = str(security.redis_ca_file)
    if security.redis_cert_file is not None:
        options["ssl_certfile"] = str(security.redis_cert_file)
        options["ssl_keyfile"] = str(security.redis_key_file)
    return options


async def kafka_failure_cause(
    bootstrap: str, security: ConnectionSecurity, timeout_s: float
) -> str:
    """Why a Kafka client could not start: one direct connection to the first bootstrap server.

    aiokafka reports a failed start as "Unable to bootstrap" and only logs the
    reason (a refused password, an untrusted certificate); this finds it again so
    the error can say it. Returns a short text that holds no secret.
    """
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            conn = await create_conn(
                host.strip("[]"),
                int(port),
                request_timeout_ms=int(timeout_s * 1000),
                **kafka_options(security),
            )
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except Exception as exc:  # whatever it is, it is the cause being looked for
        text, name = str(exc), type(exc).__name__
        return text if name in text else f"{name}: {text}" if text else name
    conn.close()
    return "the broker accepted a direct connection but not the client's requests"


async def kafka_connect_failed(
    bootstrap: str, security: ConnectionSecurity, exc: BaseException, timeout_s: float = 10.0
) -> ConnectFailed:
    """The error for a Kafka client that failed to start: endpoint, protocol, user and cause."""
    cause = await kafka_failure_cause(bootstrap, security, timeout_s)
    return ConnectFailed(
        f"cannot connect to Kafka at {bootstrap} ({security.kafka_description}): {cause} "
        f"[{type(exc).__name__}]; check the bootstrap servers, kafka_security_protocol, "
        "kafka_sasl_mechanism, the credentials and kafka_ca_file "
        "(flags --kafka-*, variables CONVEYOR_KAFKA_*)"
    )


def redis_connect_failed(redis_url: SecretStr, exc: BaseException) -> ConnectFailed:
    """The error for a Redis client that failed its first command: endpoint and cause."""
    return ConnectFailed(
        f"cannot connect to Redis at {redis_location(redis_url)}: {exc} "
        f"[{type(exc).__name__}]; check redis_url, redis_username, the password and "
        "redis_ca_file (flags --redis-*, variables CONVEYOR_REDIS_*)"
    )


def redis_location(redis_url: SecretStr) -> str:
    """The Redis URL without user or password, fit for error messages and logs."""
    parts = urlsplit(redis_url.get_secret_value())
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)
