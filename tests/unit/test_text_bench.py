"""bench.text --quick: runs on the CPU, and batching by tokens pads less than a fixed count."""

from __future__ import annotations

import json
from pathlib import Path

from bench.text import main


def test_the_quick_text_bench_reports_every_row(tmp_path: Path) -> None:
    assert main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "text-bench.json").read_text())
    (found,) = report["models"].values()
    assert found["texts"] == 200
    assert 8 <= found["tokens_median"] < found["tokens_p99"] <= 512  # a long-tailed mix
    for row in ("tokenize", "tokens", "count", "forward"):
        assert found[row]["texts_per_s"] > 0
    # The same texts: grouped by length into token batches, far less of what is computed
    # is padding than in batches of a fixed count padded to their longest text.
    assert found["tokens"]["padded_share"] < found["count"]["padded_share"]
