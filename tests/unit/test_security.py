"""Security settings: validation, and the client options built from them (no services)."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from common.security import kafka_options, redis_location, redis_options
from producers.settings import ClientSettings
from workers.cli import add_arguments, settings_from_args

SECRET = "hunter2-secret"


@pytest.fixture
def pem(tmp_path: Path) -> Path:
    """A file that exists (the settings check paths; only building a context reads them)."""
    path = tmp_path / "ca.pem"
    path.write_text("not read by these tests\n")
    return path


def test_defaults_are_plain_connections_without_credentials() -> None:
    settings = ClientSettings()
    assert kafka_options(settings) == {"security_protocol": "PLAINTEXT"}
    assert redis_options(settings) == {}


def test_sasl_ssl_gives_a_verifying_context_and_the_credentials() -> None:
    settings = ClientSettings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_username="conveyor",
        kafka_password=SecretStr(SECRET),
    )
    options = kafka_options(settings)
    context = options.pop("ssl_context")
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "conveyor",
        "sasl_plain_password": SECRET,
    }
    assert SECRET not in repr(settings)
    assert settings.kafka_description == "SASL_SSL, SCRAM-SHA-512 as conveyor"


def test_redis_options_carry_the_user_password_and_tls_files(pem: Path) -> None:
    settings = ClientSettings(
        redis_url=SecretStr("rediss://cache:6380/0"),
        redis_username="conveyor",
        redis_password=SecretStr(SECRET),
        redis_ca_file=pem,
        redis_cert_file=pem,
        redis_key_file=pem,
    )
    assert redis_options(settings) == {
        "username": "conveyor",
        "password": SECRET,
        "ssl_ca_certs": str(pem),
        "ssl_certfile": str(pem),
        "ssl_keyfile": str(pem),
    }


def test_redis_location_drops_user_and_password() -> None:
    url = SecretStr(f"rediss://conveyor:{SECRET}@cache:6380/1")
    assert redis_location(url) == "rediss://cache:6380/1"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"kafka_security_protocol": "SASL_SSL", "kafka_password": SECRET},
            "kafka_security_protocol SASL_SSL needs kafka_username and kafka_password",
        ),
        ({"kafka_ca_file": "{pem}"}, "need kafka_security_protocol SSL or SASL_SSL"),
        (
            {"kafka_security_protocol": "SSL", "kafka_cert_file": "{pem}"},
            "kafka_cert_file and kafka_key_file go together",
        ),
        ({"redis_ca_file": "{pem}"}, "need a rediss:// redis_url"),
        ({"kafka_security_protocol": "SASL_SSL", "kafka_ca_file": "/no/such.pem"}, "path"),
    ],
)
def test_inconsistent_settings_fail_naming_the_fields_without_echoing_secrets(
    pem: Path, given: dict[str, str], message: str
) -> None:
    values = {name: value.format(pem=pem) for name, value in given.items()}
    with pytest.raises(ValidationError) as error:
        ClientSettings(**values)  # type: ignore[arg-type]
    assert message in str(error.value)
    assert SECRET not in str(error.value)


def test_worker_takes_every_security_setting_as_a_flag(pem: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            *("--model", "digits", "--kafka-security-protocol", "SASL_SSL"),
            *("--kafka-sasl-mechanism", "SCRAM-SHA-256", "--kafka-username", "w"),
            *("--kafka-password", SECRET, "--kafka-ca-file", str(pem)),
            *("--redis-url", "rediss://cache:6380/0", "--redis-password", SECRET),
        ]
    )
    settings = settings_from_args(args)
    assert settings.kafka_password == SecretStr(SECRET)
    assert settings.redis_password == SecretStr(SECRET)
    assert settings.kafka_ca_file == pem
    assert settings.kafka_sasl_mechanism == "SCRAM-SHA-256"
    assert SECRET not in repr(settings)
