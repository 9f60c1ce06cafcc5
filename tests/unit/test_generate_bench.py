"""bench.generate runs end to end on the CPU (a tiny Llama, a few requests), so the
script the H200 run needs cannot rot. Never checks speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.generate import main


@pytest.mark.timeout(180)
def test_the_quick_cpu_run_measures_every_number(tmp_path: Path) -> None:
    out = tmp_path / "generate.json"
    assert main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["config"] == "tiny"
    (level,) = report["levels"]
    assert level["output_tokens"] > 0
    for name in ("engine_tokens_per_s", "static_tokens_per_s", "roofline_tokens_per_s"):
        assert level[name] > 0, name
    assert level["roofline"]["bytes_per_step"] > level["roofline"]["weights_bytes"]
    half = level["half_peak"]
    assert 0 < half["ttft_p50_ms"] <= half["ttft_p99_ms"]
    assert 0 < half["tbt_p50_ms"] <= half["tbt_p99_ms"]
