"""bench.precision runs on the CPU end to end (a small torchvision model, its own weights
saved and loaded, two generated photographs; random weights on the photographs bundled
with scikit-learn and scikit-image), so the script cannot rot between GPU runs; and it
refuses a comparison that would mean nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from bench.precision import by_position, main


def _photos(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for n, suffix in enumerate((".jpg", ".png")):
        pixels = rng.integers(0, 256, (120 + 40 * n, 160, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"photo{n}{suffix}")
    return folder


@pytest.mark.timeout(120)
def test_cpu_run_compares_each_precision_with_float32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weights = tmp_path / "weights.pt"
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), weights)
    out = tmp_path / "precision.json"
    assert main(["--model", "torchvision:mobilenet_v3_small", "--weights", str(weights),
                 "--images", str(_photos(tmp_path / "photos")), "--crops", "3",
                 "--precisions", "float32,bfloat16", "--batch", "4", "--iterations", "1",
                 "--device", "cpu", "--no-compile", "--out", str(out)]) == 0  # fmt: skip

    (row,) = json.loads(out.read_text())["models"]
    assert row["crops"] == 6
    assert row["float32"]["img_s"] > 0
    assert 1 <= len(row["float32"]["top1_classes"]) <= 5
    assert row["float32"]["layers"] == {"Conv2d_plain": 52, "Linear_plain": 2}
    assert 0.0 <= row["bfloat16"]["top1_agreement"] <= 1.0
    assert 0.0 <= row["bfloat16"]["max_score_difference"] <= 1.0


@pytest.mark.timeout(180)
def test_random_weights_are_compared_on_the_bundled_photographs_and_say_how_weak(
    tmp_path: Path,
) -> None:
    from bench.precision import bundled_photos

    photos = bundled_photos()  # scikit-learn's two at least: the demo extra installs it
    assert {"china.jpg", "flower.jpg"} <= {p.name for p in photos}
    out = tmp_path / "precision.json"
    assert main(["--random-weights", "torchvision:mobilenet_v3_small", "--images", "bundled",
                 "--crops", "1", "--precisions", "float32,bfloat16", "--batch", "16",
                 "--iterations", "1", "--device", "cpu", "--no-compile",
                 "--out", str(out)]) == 0  # fmt: skip

    (row,) = json.loads(out.read_text())["models"]
    assert (row["weights"], row["crops"]) == ("random", len(photos))
    assert 1 <= row["float32"]["top1_classes_seen"] <= len(photos)
    assert row["float32"]["margin_p50"] >= 0.0
    assert 0.0 <= row["bfloat16"]["top1_agreement"] <= 1.0


def test_agreement_on_random_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "torchvision:resnet18", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):  # asked for by name only, and with photographs
        main(["--random-weights", "torchvision:resnet18", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):  # float32 is the reference: it comes first
        main(["--speed-only", "torchvision:resnet18", "--speed-precisions", "float16",
              "--out", str(tmp_path / "x.json")])  # fmt: skip


def test_weights_in_order_map_by_position_and_refuse_a_mismatch() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    renamed = {
        f"other.{n}.{key}": value + 1 for n, (key, value) in enumerate(model.state_dict().items())
    }
    mapped = by_position(renamed, model)
    assert torch.equal(mapped["fc.weight"], model.state_dict()["fc.weight"] + 1)
    assert set(mapped) == set(model.state_dict())

    short = dict(list(renamed.items())[:-1])
    with pytest.raises(SystemExit, match="tensors for"):
        by_position(short, model)
    wrong = {
        key: (torch.zeros(3) if key.endswith("fc.weight") else value)
        for key, value in renamed.items()
    }
    with pytest.raises(SystemExit, match=r"fc\.weight"):
        by_position(wrong, model)
