"""Compiled packages: built once per model and bucket, loaded with the live model's weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from demo.models.digits import DigitsClassifier
from workers.model.packages import fingerprint_model, package_fingerprint, packaged_forward
from workers.model.runner import ModelRunner

BUCKETS = (4,)


def digits_batch(handler: DigitsClassifier, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(size)
    shape = (size, *handler.example_item().shape)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def packaged_runner(handler: DigitsClassifier, folder: Path) -> ModelRunner:
    runner = ModelRunner(handler, "cpu", compile="package", packages=folder, buckets=BUCKETS)
    runner.warm_up()
    return runner


def test_a_package_is_built_once_and_serves_the_weights_of_the_model_that_loads_it(
    tmp_path: Path,
) -> None:
    first = DigitsClassifier()
    packaged_runner(first, tmp_path)
    packages = sorted(tmp_path.glob("*.bin"))
    assert len(packages) == len(BUCKETS)
    built = [p.stat().st_mtime_ns for p in packages]

    # Another process's model with other weights (same architecture) loads the package,
    # and the package computes with the weights it was handed, not the first model's.
    second = DigitsClassifier()
    with torch.no_grad():
        for parameter in second.module.parameters():
            parameter.mul_(-0.5)
    runner = packaged_runner(second, tmp_path)
    assert sorted(tmp_path.glob("*.bin")) == packages
    assert [p.stat().st_mtime_ns for p in packages] == built

    batch = digits_batch(second, BUCKETS[0])
    with torch.inference_mode():
        served = runner._forward(batch)
        expected = second.forward(batch)
        other = first.forward(batch)
    assert torch.allclose(served, expected, atol=1e-4)
    assert not torch.allclose(served, other, atol=1e-2)
    assert not list(tmp_path.glob(".partial-*"))


def test_a_model_with_other_layers_or_settings_gets_packages_of_its_own() -> None:
    def fingerprint(handler: DigitsClassifier) -> str:
        network = handler.exportable()
        assert network is not None
        return fingerprint_model(network)

    plain = fingerprint(DigitsClassifier())
    reweighted = DigitsClassifier()
    with torch.no_grad():
        next(reweighted.module.parameters()).mul_(2)
    assert fingerprint(reweighted) == plain  # the weights are handed over at each load

    activation = DigitsClassifier()
    layers = activation.module
    assert isinstance(layers, torch.nn.Sequential)
    layers[1] = torch.nn.GELU()  # same file as ReLU, same tensors
    strided = DigitsClassifier()
    first = strided.module.get_submodule("0")
    assert isinstance(first, torch.nn.Conv2d)
    first.padding = (0, 0)  # same tensors, other code
    fingerprints = {plain, fingerprint(activation), fingerprint(strided)}
    assert len(fingerprints) == 3


def test_a_package_built_on_one_card_is_not_the_one_another_card_loads() -> None:
    """Inductor's code names the card it was compiled on: ``cuda:1`` loading the package
    built on ``cuda:0`` launched its kernels in the other card's context."""
    model = fingerprint_model(torch.nn.Linear(2, 2))
    layout = "(8, 2):torch.float16:(2, 1)"
    names = {
        package_fingerprint(model, layout, torch.device(device))
        for device in ("cuda:0", "cuda:1", "cpu")
    }
    assert len(names) == 3


class Branching(torch.nn.Module):
    """A forward that depends on its input's values: torch.export cannot take it."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.float()
        return x * 2 if x.sum() > 0 else x


def test_a_model_that_does_not_export_is_reported_and_left_to_torch_compile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "workers.model.packages")
    forward = packaged_forward(Branching(), [2], lambda size: torch.ones(size, 3), tmp_path)
    assert forward is None
    assert "torch.compile instead" in caplog.text
    assert not list(tmp_path.iterdir())
