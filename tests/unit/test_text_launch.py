"""bench.text_launch measures a CUDA device's launches: without one it says so and stops."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import text_launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_exits_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.text_launch"])
    with pytest.raises(SystemExit, match="CUDA device"):
        text_launch.main()
