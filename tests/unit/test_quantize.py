"""--quantize int8: the linear layers in int8 through torchao, answers as float32's,
compiled into packages like any model, and clear refusals where it does not apply."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from common.install import install_hint
from demo.models.digits import DigitsClassifier
from schemas import DEFAULT_LIMITS, ContentType
from workers.config.profiles import tuned
from workers.config.worker import WorkerSettings
from workers.handlers.weights import ModelLoadError
from workers.model.loader import load_handler
from workers.model.packages import fingerprint_model, is_subclass_tensor
from workers.model.quantize import quantize_handler
from workers.model.runner import ModelRunner

pytest.importorskip("torchao", reason="the quant extra (make install has it)")


def labels(
    runner: ModelRunner, handler: DigitsClassifier, digits: list[tuple[bytes, int]]
) -> list[int]:
    items = [handler.preprocess(png, ContentType.PNG, {}) for png, _ in digits]
    answers = []
    for start in range(0, len(items), 32):
        chunk = items[start : start + 32]
        answers += runner.run(chunk, [{}] * len(chunk))
    return [int(answer[0]["label"]) for answer in answers]


def test_int8_digits_answer_as_float32_does(
    digits: list[tuple[bytes, int]], caplog: pytest.LogCaptureFixture
) -> None:
    plain = DigitsClassifier()
    quantized = DigitsClassifier()
    with caplog.at_level(logging.INFO, logger="workers.model.quantize"):
        quantize_handler(quantized, "int8")
    assert "2 of 2 linear layers quantized to int8" in caplog.text
    layers = [m for m in quantized.module.modules() if isinstance(m, torch.nn.Linear)]
    assert all(is_subclass_tensor(m.weight) for m in layers)
    truth = [digit for _, digit in digits]
    reference = labels(ModelRunner(plain, "cpu"), plain, digits)
    got = labels(ModelRunner(quantized, "cpu"), quantized, digits)
    agreement = sum(a == b for a, b in zip(got, reference, strict=True)) / len(digits)
    assert agreement >= 0.99
    correct = [sum(a == t for a, t in zip(run, truth, strict=True)) for run in (got, reference)]
    assert abs(correct[0] - correct[1]) <= len(digits) // 100


def test_an_int8_model_compiles_with_torch_compile_unless_told_otherwise() -> None:
    settings = WorkerSettings(model="digits", quantize="int8")
    assert tuned(settings, cuda=True, fixed_size_images=True).compile_form == "static"
    told = WorkerSettings(model="digits", quantize="int8", compile_form="dynamic")
    assert tuned(told, cuda=True, fixed_size_images=True).compile_form == "dynamic"
    assert (
        tuned(WorkerSettings(model="digits"), cuda=True, fixed_size_images=True).compile_form
        == "package"
    )

    quantized = DigitsClassifier()
    quantize_handler(quantized, "int8")
    runner = ModelRunner(quantized, "cpu", compile="static", buckets=(8,))
    runner.warm_up()
    generator = torch.Generator().manual_seed(8)
    batch = torch.randint(0, 256, (8, *quantized.example_item().shape), dtype=torch.uint8,
                          generator=generator)  # fmt: skip
    with torch.inference_mode():
        served = runner._forward(batch)
        eager = quantized.forward(batch)
    assert torch.allclose(served, eager, atol=1e-3)
    # Packages are never shared with the float model: the weights' types name them apart.
    network, plain_network = quantized.exportable(), DigitsClassifier().exportable()
    assert network is not None
    assert plain_network is not None
    assert fingerprint_model(network) != fingerprint_model(plain_network)


def load(spec: str) -> object:
    return load_handler(spec, device="cpu", weights="random", dtype="float32",
                        channels_last=None, limits=DEFAULT_LIMITS)  # fmt: skip


def test_quantize_refuses_what_it_does_not_apply_to(monkeypatch: pytest.MonkeyPatch) -> None:
    digits = DigitsClassifier()
    quantize_handler(digits, "none")
    assert not any(is_subclass_tensor(p) for p in digits.module.parameters())
    with pytest.raises(ModelLoadError, match="quantize 'int4' is not one of none, int8"):
        quantize_handler(digits, "int4")
    detector = load("torchvision:fasterrcnn_mobilenet_v3_large_320_fpn")
    with pytest.raises(ModelLoadError, match="applies to image classifiers and embedding models"):
        quantize_handler(detector, "int8")  # type: ignore[arg-type]
    embedder = load("embedding:resnet18")  # its one linear layer, the head, is gone
    with pytest.raises(ModelLoadError, match="quantizes linear layers and this model has none"):
        quantize_handler(embedder, "int8")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ModelLoadError, match=f"needs torchao.*{re.escape(install_hint('quant'))}"):
        quantize_handler(DigitsClassifier(), "int8")
