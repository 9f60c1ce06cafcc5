"""The demo digits model: accuracy, an exact PNG round trip, and the artifact's life cycle."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from demo.models.digits import (
    DIGITS_VERSION,
    MIN_HELDOUT_ACCURACY,
    DigitsClassifier,
    ModelCacheError,
    build_digits_model,
    default_model_path,
    digit_pixels,
    digit_png,
    digits_metadata,
    heldout_digits,
    heldout_indices,
)
from schemas import ContentType
from workers.handlers.base import ImageClassifier
from workers.model.runner import ModelRunner


@pytest.fixture(scope="module")
def digits() -> ImageClassifier:
    # The default artifact path: built once on this machine, loaded in milliseconds after.
    return DigitsClassifier()


def predict(handler: ImageClassifier, tensors: list[torch.Tensor]) -> list[int]:
    results = ModelRunner(handler, "cpu").run(tensors, [{"top_k": 1}] * len(tensors))
    return [r[0]["index"] for r in results]


def test_heldout_accuracy_through_the_served_path_is_at_least_95_percent(
    digits: ImageClassifier,
) -> None:
    heldout = heldout_digits()
    tensors = [digits.preprocess(png, ContentType.PNG, {}) for png, _ in heldout]

    predicted = predict(digits, tensors)

    accuracy = np.mean([p == truth for p, (_, truth) in zip(predicted, heldout, strict=True)])
    assert accuracy >= MIN_HELDOUT_ACCURACY
    # The accuracy recorded at build time is the one a client sees.
    assert accuracy == pytest.approx(digits_metadata()["heldout_accuracy"], abs=1.5 / len(heldout))


def test_heldout_set_is_a_fixed_stratified_fifth_of_the_data() -> None:
    target = load_digits().target
    heldout = heldout_indices()
    assert len(heldout) == 360
    assert np.array_equal(heldout, heldout_indices())
    assert np.bincount(target[heldout], minlength=10).min() >= 35  # every digit ~36 times
    assert [truth for _, truth in heldout_digits()] == target[heldout].tolist()


def test_png_round_trip_is_exact() -> None:
    images = load_digits().images[:50]
    for values in images:
        with Image.open(io.BytesIO(digit_png(values))) as img:
            assert (img.mode, img.size) == ("L", (8, 8))
            assert np.array_equal(np.asarray(img) / 15, values)


def test_preprocessed_png_is_exactly_the_training_tensor(digits: ImageClassifier) -> None:
    indices = heldout_indices()
    pixels, _ = digit_pixels(indices)
    for (png, _), expected in zip(heldout_digits(), pixels, strict=True):
        assert torch.equal(digits.preprocess(png, ContentType.PNG, {}), expected)


def test_predictions_on_pngs_equal_predictions_on_training_arrays(
    digits: ImageClassifier,
) -> None:
    pixels, _ = digit_pixels(heldout_indices())
    from_pngs = [digits.preprocess(png, ContentType.PNG, {}) for png, _ in heldout_digits()]
    assert predict(digits, from_pngs) == predict(digits, list(pixels))


def test_images_of_other_sizes_and_modes_are_accepted(digits: ImageClassifier) -> None:
    heldout = heldout_digits()[:40]
    agree = 0
    for png, truth in heldout:
        with Image.open(io.BytesIO(png)) as img:
            big = img.convert("RGB").resize((64, 64), Image.Resampling.NEAREST)
        buffer = io.BytesIO()
        big.save(buffer, format="PNG")
        tensor = digits.preprocess(buffer.getvalue(), ContentType.PNG, {})
        assert tensor.shape == (1, 8, 8)
        agree += predict(digits, [tensor]) == [truth]
    assert agree >= 0.9 * len(heldout)


@pytest.mark.parametrize(
    "values", [np.zeros((8, 7)), np.full((8, 8), 17), np.full((8, 8), 0.5), np.full((8, 8), -1)]
)
def test_digit_png_refuses_values_that_are_not_a_digit(values: np.ndarray) -> None:
    with pytest.raises(ValueError, match="digit"):
        digit_png(values)


def test_default_path_follows_conveyor_model_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CONVEYOR_MODEL_DIR", str(tmp_path))
    assert default_model_path() == tmp_path / f"{DIGITS_VERSION}.pt"
    monkeypatch.delenv("CONVEYOR_MODEL_DIR")
    # Otherwise the user's cache folder, never beside the installed package (root's).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_path() == tmp_path / "xdg/conveyor-serve/models" / f"{DIGITS_VERSION}.pt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_path() == (
        tmp_path / "home/.cache/conveyor-serve/models" / f"{DIGITS_VERSION}.pt"
    )


def test_an_unwritable_model_folder_says_what_to_set(tmp_path: Path) -> None:
    # A regular file where the folder should be: refused for root too, unlike permissions.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(ModelCacheError, match="set CONVEYOR_MODEL_DIR to a folder") as error:
        build_digits_model(blocker / "models" / "digits.pt")
    assert error.value.errno is not None


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_build_trains_a_safe_artifact_once_and_rebuilds_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "models" / "digits.pt"

    assert build_digits_model(path) == path

    artifact = torch.load(path, weights_only=True)  # plain tensors and metadata only
    assert artifact["version"] == DIGITS_VERSION
    assert artifact["labels"] == [str(d) for d in range(10)]
    assert artifact["heldout_accuracy"] >= MIN_HELDOUT_ACCURACY
    assert list(tmp_path.joinpath("models").iterdir()) == [path]  # no temporary file left
    built = path.stat().st_mtime_ns
    assert build_digits_model(path) == path
    assert path.stat().st_mtime_ns == built  # reused, not retrained

    path.write_bytes(b"half a file")
    build_digits_model(path)
    assert torch.load(path, weights_only=True)["version"] == DIGITS_VERSION
