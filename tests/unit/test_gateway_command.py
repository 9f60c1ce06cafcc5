"""``conveyor gateway`` parses its settings before it starts anything, and refuses bad
ones with status 2 and a line naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.cli import main
from producers.gateway.command import EXIT_BAD_INPUT, EXIT_UNAVAILABLE


def test_a_client_ca_without_a_server_certificate_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not read before the settings are checked")
    monkeypatch.setenv("CONVEYOR_GATEWAY_TLS_CA_FILE", str(ca))
    assert main(["gateway", "--port", "0"]) == EXIT_BAD_INPUT
    assert "gateway_tls_ca_file" in capsys.readouterr().err


def test_a_redis_cluster_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONVEYOR_REDIS_CLUSTER", "true")
    assert main(["gateway"]) == EXIT_BAD_INPUT
    assert "standalone Redis" in capsys.readouterr().err


def test_a_max_lag_that_is_not_a_number_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--max-lag", "lots"]) == EXIT_BAD_INPUT
    assert "gateway_max_lag" in capsys.readouterr().err


def test_a_gateway_that_cannot_reach_kafka_exits_4(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["gateway", "--port", "0", "--kafka-bootstrap", "127.0.0.1:1"]
    assert main([*argv]) == EXIT_UNAVAILABLE
    assert "did not start" in capsys.readouterr().err
