"""``make demo-text``'s path end to end: a model built here, topics, a worker process
serving it as ``hf:FOLDER``, ``text/plain`` requests through the SDK, and the report."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from demo.text import main

HELD_OUT = 120
_ANSWERED = re.compile(r"(\d+)/(\d+) reviews answered; accuracy (\d+\.\d)% served, (\d+\.\d)%")
_AGREEING = re.compile(r"equal the offline ones for (\d+) of (\d+)")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_text_serves_the_labels_the_model_gives_offline(
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    drop_topics: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    drop_topics.append(model_name)  # the demo creates them
    # A short training keeps the test fast: the demo checks agreement, not accuracy.
    argv = ["--model-name", model_name, "--folder", str(tmp_path / "reviews-bert")]
    argv += ["--held-out", str(HELD_OUT), "--max-steps", "60", "--timeout", "180"]
    status = main([*argv, "--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url])

    out = capsys.readouterr().out
    assert status == 0, out
    answered = _ANSWERED.search(out)
    assert answered is not None, out
    ok, reviews, served, offline = answered.groups()
    assert int(ok) == int(reviews) == HELD_OUT
    assert served == offline
    agreeing = _AGREEING.search(out)
    assert agreeing is not None, out
    assert agreeing.groups() == (str(HELD_OUT), str(HELD_OUT))
    assert "latency p50" in out
    assert (tmp_path / "reviews-bert" / "model.safetensors").exists()
