"""bench.gpu runs its CPU-capable stages end to end, so the script cannot rot between GPU runs.

The model is a tiny image classifier (below) served through the same loader spec
form users have, so the smoke test exercises every code path of the stages in
seconds; the real run uses ResNet-50 on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu import main, synthetic_jpeg
from schemas import DEFAULT_LIMITS, Limits
from workers.handlers import ImageClassifier
from workers.loader import IMAGENET_IMAGE, IMAGENET_MEAN, IMAGENET_STD


class TinyClassifier(ImageClassifier):
    """A 10-class conv net on ImageNet-sized input that costs milliseconds on a CPU."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        limits: Limits = DEFAULT_LIMITS,
        decode: Any = "auto",
    ) -> None:
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(4, 10),
        )  # fmt: skip
        super().__init__(
            module,
            name="tiny",
            version="tiny:random-weights",
            labels=[str(i) for i in range(10)],
            image=IMAGENET_IMAGE,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            decode=decode,
        )


def test_synthetic_jpegs_have_photo_like_sizes() -> None:
    assert 120_000 < len(synthetic_jpeg(640, 480, seed=1)) < 175_000
    assert 20_000 < len(synthetic_jpeg(224, 224, seed=1)) < 31_000


@pytest.mark.timeout(60)
def test_quick_cpu_run_writes_results_a_plot_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = f"{__name__}:TinyClassifier"
    stages = "a,b,c,checks,overlap,pipeline,d"  # d (e2e) is skipped: no --kafka-bootstrap
    assert main(["--device", "cpu", "--quick", "--model", model, "--stages", stages,
                 "--out", str(tmp_path)]) == 0  # fmt: skip

    results = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert set(results["stage_s"]) == {
        "forward",
        "decode",
        "naive",
        "checks",
        "overlap",
        "pipeline",
    }
    assert results["forward"]["eager"]["2"]["img_s"] > 0
    for corpus in ("640x480", "224x224"):
        assert results["decode"][corpus]["nvjpeg_decode_resize"] > 0
        assert results["naive"][corpus]["img_s"] > 0
        assert results["pipeline"][f"gpu-decode {corpus}"]["img_s"] > 0
        # The batched path on the CPU decodes with the same libjpeg as Pillow: only the
        # resize's rounding differs (see tests/unit/test_gpu_decode.py).
        assert results["checks"][corpus]["decode_max_abs_diff_levels"] <= 1
    assert (tmp_path / "gpu-bench.png").stat().st_size > 0
    output = capsys.readouterr().out
    assert "e2e skipped" in output
    assert "×naive" in output.splitlines()[-4]  # the table comes last
    assert results["overlap"]["gpu 640x480"]["decode_alone_img_s"] > 0
