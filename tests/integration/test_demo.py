"""``make demo``'s path end to end: build, topics, a worker process, the SDK, the report."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from demo.digits import main
from demo.models.digits import digits_metadata
from schemas import topics_for

_SUMMARY = re.compile(r"accuracy (\d+\.\d+)% \((\d+)/(\d+)\), offline (\d+\.\d+)%")


@pytest.fixture
async def demo_model(kafka_admin: AIOKafkaAdminClient, model_name: str) -> AsyncIterator[str]:
    """The demo's model name; its topics are deleted afterwards."""
    yield model_name
    topics = topics_for(model_name)
    await kafka_admin.delete_topics([topics.requests, topics.results, topics.dlq])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_serves_the_heldout_digits_as_accurately_as_offline(
    kafka_bootstrap: str,
    redis_url: str,
    demo_model: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model-name", demo_model, "--device", "cpu", "--timeout", "180"]
    argv += ["--worker-log", str(tmp_path / "worker.log")]
    status = main([*argv, "--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url])

    out = capsys.readouterr().out
    assert status == 0, out
    summary = _SUMMARY.search(out)
    assert summary is not None, out
    served, correct, answered, offline = summary.groups()
    assert int(answered) == digits_metadata()["heldout_size"]  # every held-out digit answered
    assert int(correct) <= int(answered)
    assert abs(float(served) - float(offline)) <= 1.0, out
    assert "latency p50" in out
    assert "[demo] worker stopped" in out
