"""ModelRunner: device resolution, batching that never mixes up items, warm-up."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from demo.models.digits import DigitsClassifier, heldout_digits
from schemas import ContentType
from tests.fakes import Echo
from workers.decode.jpeg import READ_MODES, decode_each
from workers.handlers.base import ImageClassifier
from workers.model.runner import (
    WARM_UP_SHAPE_ROWS,
    ModelRunner,
    batch_buckets,
    compile_forward,
    resolve_device,
    static_input,
)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")


@pytest.fixture(scope="module")
def digits() -> ImageClassifier:
    # The default artifact path: built once on this machine, loaded in milliseconds after.
    return DigitsClassifier()


def test_cpu_and_auto_resolve_to_the_cpu_without_a_gpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")


@no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_asking_for_a_gpu_where_there_is_none_says_what_to_pass(device: str) -> None:
    with pytest.raises(ValueError, match="--device cpu"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu"])
def test_unknown_devices_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device(device)


def test_each_result_answers_its_own_item_and_params() -> None:
    runner = ModelRunner(Echo(), "cpu")
    tensors = [torch.tensor([i, i + 1, i + 2]) for i in range(5)]
    params = [{"n": i} for i in range(5)]

    results = runner.run(tensors, params)

    assert results == [
        {"out": [10 * i, 10 * (i + 1), 10 * (i + 2)], "params": {"n": i}} for i in range(5)
    ]


def test_a_batch_gives_what_each_item_gives_alone(digits: ImageClassifier) -> None:
    runner = ModelRunner(digits, "cpu")
    items = heldout_digits()[:24]
    tensors = [digits.preprocess(png, ContentType.PNG, {}) for png, _ in items]
    params = [{"top_k": 1 + i % 4} for i in range(len(items))]

    batched = runner.run(tensors, params)
    alone = [runner.run([t], [p])[0] for t, p in zip(tensors, params, strict=True)]

    for together, single in zip(batched, alone, strict=True):
        assert [r["index"] for r in together] == [r["index"] for r in single]
        assert [r["score"] for r in together] == pytest.approx(
            [r["score"] for r in single], rel=1e-4, abs=1e-6
        )


def test_params_and_tensors_must_pair_up() -> None:
    runner = ModelRunner(Echo(), "cpu")
    with pytest.raises(ValueError, match="need one each"):
        runner.run([torch.zeros(3, dtype=torch.int64)], [])
    assert runner.run([], []) == []


def test_a_handler_that_drops_results_is_caught() -> None:
    class Lossy(Echo):
        def postprocess(
            self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]
        ) -> list[Any]:
            return super().postprocess(outputs, params)[:-1]

    runner = ModelRunner(Lossy(), "cpu")
    with pytest.raises(RuntimeError, match="returned 1 results for a batch of 2"):
        runner.run([torch.zeros(3, dtype=torch.int64)] * 2, [{}, {}])


def test_model_errors_propagate_for_the_caller_to_isolate() -> None:
    runner = ModelRunner(Echo(), "cpu")
    with pytest.raises(RuntimeError):
        runner.run([torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)], [{}, {}])


def test_warm_up_runs_each_batch_size_once() -> None:
    handler = Echo()
    ModelRunner(handler, "cpu").warm_up([8, 1, 2, 8, 4])
    assert handler.batch_sizes == [1, 2, 4, 8]


def test_a_compiled_warm_up_runs_a_batch_of_each_shape_a_handler_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shapes are traced at start when the forward is compiled (here a stand-in for
    torch.compile that calls the forward as it is); an eager forward skips them."""

    class Shaped(Echo):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def warm_up_items(self) -> list[torch.Tensor]:
            return [torch.zeros(5, dtype=torch.int64), torch.zeros(9, dtype=torch.int64)]

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            self.shapes.append(tuple(batch.shape))
            return super().forward(batch)

    eager = Shaped()
    ModelRunner(eager, "cpu").warm_up([1, 4])
    assert eager.shapes == [(1, 3), (4, 3)]

    def stand_in(forward: Any, *_: object) -> Any:
        return lambda batch: forward(batch)

    monkeypatch.setattr("workers.model.runner.compile_forward", stand_in)
    compiled = Shaped()
    ModelRunner(compiled, "cpu", compile="static").warm_up([1, 4])
    assert compiled.shapes == [(1, 3), (4, 3), (WARM_UP_SHAPE_ROWS, 5), (WARM_UP_SHAPE_ROWS, 9)]


def test_warm_up_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ModelRunner(Echo(), "cpu").warm_up([0])


def test_forward_runs_in_inference_mode() -> None:
    seen: list[bool] = []

    class Probe(Echo):
        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_inference_mode_enabled())
            return batch

    ModelRunner(Probe(), "cpu").run([torch.zeros(3, dtype=torch.int64)], [{}])
    assert seen == [True]


def test_a_list_built_by_collate_reaches_forward_as_it_is_never_padded() -> None:
    class Sizes(Echo):
        """A handler whose items differ in size: ``collate`` hands ``forward`` a list."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[list[int]] = []

        def collate(
            self, items: Sequence[torch.Tensor], device: torch.device
        ) -> list[torch.Tensor]:
            return [item.to(device) for item in items]

        def forward(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[override]
            self.seen.append([len(item) for item in batch])
            return [item.sum() for item in batch]

        def postprocess(  # a list per batch, not a tensor: what forward gave it
            self,
            outputs: list[torch.Tensor],  # type: ignore[override]
            params: Sequence[Mapping[str, Any]],
        ) -> list[Any]:
            return [int(total) for total in outputs]

    handler = Sizes()
    runner = ModelRunner(handler, "cpu", buckets=(8,))
    items = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 4)]

    assert runner.run(items, [{}] * 3) == [3, 0, 6]
    assert handler.seen == [[3, 1, 4]]  # three items, not padded to the bucket of 8


def test_a_graphs_static_input_does_not_recompile_a_compiled_forward() -> None:
    """The copy a CUDA graph records with is an inference tensor like the warm-up's
    batches: a compiled forward takes it without compiling again (a plain clone made
    outside inference mode compiled every bucket again, past dynamo's limit)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forward = torch.compile(lambda x: torch.relu(x) * 2, dynamic=False, backend="eager")
    with torch.inference_mode():
        batch = torch.randn(4, 3)
        forward(batch)
    static = static_input(batch)
    assert static.is_inference()
    assert torch.equal(static, batch)
    assert static.data_ptr() != batch.data_ptr()  # a copy: replays overwrite it
    with torch.inference_mode():
        forward(static)
    assert counters["stats"]["unique_graphs"] == 1
    plain = batch.clone()  # what the capture used to record with
    with torch.inference_mode():
        forward(plain)
    assert counters["stats"]["unique_graphs"] == 2  # the guard this test is about still exists


def test_a_dynamic_batch_compiles_one_graph_for_every_bucket() -> None:
    """``dynamic_batch`` marks the batch dimension before the first compilation, so the
    six buckets of batches up to 256 share one graph (torch's default would compile the
    first size static and a second graph once it saw another; static compiles six)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    forward = compile_forward(lambda x: torch.relu(x) * 2, batch_buckets(256), dynamic_batch=True)
    with torch.inference_mode():
        for size in batch_buckets(256):
            batch = torch.randn(size, 3)
            assert torch.equal(forward(batch), torch.relu(batch) * 2)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_runner_that_keeps_images_hands_back_those_the_model_saw() -> None:
    """A detector whose JPEGs are decoded where the model runs (``decode gpu``: on the
    CPU here, through the same batch decoder): with ``keep_images`` each item's image
    comes back with its output, as decoded there, for a next stage's crops."""
    from demo.models.detector import DigitsDetector

    rng = np.random.default_rng(3)
    payloads = []
    for size in ((96, 64), (120, 80)):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        payloads.append(buffer.getvalue())
    detector = DigitsDetector(device="cpu", decode="gpu")
    items = [detector.preprocess(p, ContentType.JPEG, {}) for p in payloads]
    assert all(item.dim() == 1 for item in items)  # kept encoded, for the batch decoder

    for keep in (True, False):
        runner = ModelRunner(detector, "cpu", keep_images=keep)
        launched = runner.launch(runner.prepare(items), [{}, {}])
        outputs = runner.finish(launched)
        assert [(o["width"], o["height"]) for o in outputs] == [(96, 64), (120, 80)]
        if not keep:
            assert launched.images is None
            continue
        assert launched.images is not None
        seen = decode_each(items, READ_MODES[detector.mode], torch.device("cpu"))  # as collate does
        for image, decoded in zip(launched.images, seen, strict=True):
            assert decoded is not None
            assert image.shape == decoded.shape
            assert torch.equal(image, decoded)
