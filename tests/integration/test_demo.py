"""``make demo``'s path end to end: build, topics, a worker process, the SDK, the report."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from demo.digits import main
from demo.models.digits import digits_metadata

_SUMMARY = re.compile(r"accuracy (\d+\.\d+)% \((\d+)/(\d+)\), offline (\d+\.\d+)%")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_serves_the_heldout_digits_as_accurately_as_offline(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    drop_topics.append(model_name)  # the demo creates them
    argv = ["--model-name", model_name, "--device", "cpu", "--timeout", "180"]
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
