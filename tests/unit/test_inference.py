"""The model stage on its own: the serial path and the three-thread pipeline (run here
on the CPU; on a GPU the same code overlaps decode, forward and result building)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from schemas import ErrorCode
from schemas.fastpath import FastMeta
from tests.fakes import POISON, GatedEcho
from workers.handlers.base import ImageClassifier
from workers.model.inference import PIPELINED_SLOTS, SLOTS, Inference
from workers.model.runner import ModelRunner
from workers.offsets import OffsetTracker
from workers.types import Item, Outcome

_SPAN = OffsetTracker[tuple[str, int]]().open(("t", 0), 0, 10_000, 10_001)


def items(values: list[int], *, deadline_in: float | None = None) -> list[Item]:
    import torch

    now = time.monotonic()
    out = []
    for n, value in enumerate(values):
        meta = FastMeta(f"r{n}", None, {}, None, None, None, None, None)  # type: ignore[arg-type]
        deadline = None if deadline_in is None else now + deadline_in
        out.append(
            Item(None, _SPAN, meta, 0.0, deadline, torch.tensor([value], dtype=torch.uint8))  # type: ignore[arg-type]
        )
    return out


async def run_batches(inference: Inference, batches: list[list[Item]]) -> list[Outcome]:
    done: list[Outcome] = []
    inference._on_done = done.append  # collect in delivery order
    for batch in batches:
        await inference.wait_for_slot()
        inference.submit(batch)
    await inference.wait_idle()
    return done


@pytest.mark.parametrize("pipelined", [False, True])
async def test_every_item_is_answered_and_the_poison_fails_alone(pipelined: bool) -> None:
    inference = Inference(
        ModelRunner(GatedEcho(), device="cpu"), lambda _: None, pipelined=pipelined
    )
    batches = [items([1, 2, 3]), items([4, POISON, 6]), items([7])]
    try:
        outcomes = await run_batches(inference, batches)
    finally:
        inference.close()
    answered = sorted(o for outcome in outcomes for o in outcome.outputs)
    assert answered == [1, 2, 3, 4, 6, 7]
    refused = [r for outcome in outcomes for r in outcome.refused]
    assert [(r.code, r.request_id) for r in refused] == [(ErrorCode.model_error, "r1")]
    assert inference.seconds_per_item is not None


@pytest.mark.parametrize("pipelined", [False, True])
async def test_items_past_their_deadline_never_reach_the_model(pipelined: bool) -> None:
    model = GatedEcho()
    inference = Inference(ModelRunner(model, device="cpu"), lambda _: None, pipelined=pipelined)
    try:
        outcomes = await run_batches(inference, [items([1, 2], deadline_in=-1.0), items([3])])
    finally:
        inference.close()
    refused = [r.code for outcome in outcomes for r in outcome.refused]
    assert refused == [ErrorCode.expired, ErrorCode.expired]
    assert model.seen == 1


async def test_the_pipeline_splits_postprocess_and_gives_the_serial_results() -> None:
    """A SplitPostprocess handler (the image classifier) answers the same either way."""
    import io

    import numpy as np
    from PIL import Image

    from demo.models.digits import DigitsClassifier
    from schemas import ContentType

    handler: ImageClassifier = DigitsClassifier()
    rng = np.random.default_rng(1)
    tensors = []
    for _ in range(12):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(buffer, format="PNG")
        tensors.append(handler.preprocess(buffer.getvalue(), ContentType.PNG, {}))
    batch = items([0] * 12)
    for item, tensor in zip(batch, tensors, strict=True):
        item.tensor = tensor
    results: dict[bool, list[Any]] = {}
    for pipelined in (False, True):
        inference = Inference(
            ModelRunner(handler, device="cpu"), lambda _: None, pipelined=pipelined
        )
        try:
            (outcome,) = await run_batches(inference, [batch])
        finally:
            inference.close()
        results[pipelined] = outcome.outputs
    assert results[True] == results[False]
    assert len(results[True]) == 12


COLLATE_S = 0.05


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_batch_time_in_the_model_counts_its_collate(pipelined: bool) -> None:
    """Both paths time a batch from its collate on (on a GPU: decode and upload), so
    ``inference_ms`` means the same on either and ``queue_ms`` is only the wait."""

    class SlowCollate(GatedEcho):
        """Echo, with a collate (the GPU handlers decode there) that takes COLLATE_S."""

        def collate(self, tensors: Any, device: Any) -> None:
            time.sleep(COLLATE_S)
            return None  # the runner then stacks the tensors itself

    inference = Inference(
        ModelRunner(SlowCollate(), device="cpu"), lambda _: None, pipelined=pipelined
    )
    batch = items([1, 2])
    submitted_ms = time.time() * 1000.0
    try:
        (outcome,) = await run_batches(inference, [batch])
    finally:
        inference.close()
    assert outcome.timing is not None
    assert outcome.timing.inference_ms >= COLLATE_S * 1000.0
    assert outcome.timing.start_ms - submitted_ms < COLLATE_S * 1000.0


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_batch_that_broke_the_device_is_not_answered(
    pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure that leaves the device broken (a sticky CUDA error) is nobody's input's
    fault: the batch gets no answers and no refusals, only ``lost``; others are served."""
    import workers.model.inference

    def broken(device: Any) -> BaseException:
        return RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(workers.model.inference, "device_error", broken)
    inference = Inference(
        ModelRunner(GatedEcho(), device="cpu"), lambda _: None, pipelined=pipelined
    )
    try:
        outcomes = await run_batches(inference, [items([1, 2]), items([3, POISON]), items([5])])
    finally:
        inference.close()
    lost = [o for o in outcomes if o.lost is not None]
    assert len(lost) == 1
    assert lost[0].answered == []
    assert lost[0].refused == []
    assert "illegal memory access" in str(lost[0].lost)
    assert sorted(x for o in outcomes for x in o.outputs) == [1, 2, 5]


def test_a_working_device_is_not_reported_broken() -> None:
    import torch

    from workers.model.inference import device_error

    assert device_error(torch.device("cpu")) is None


@pytest.mark.parametrize(("pipelined", "batches"), [(True, 2), (True, 1), (False, 3)])
async def test_the_stage_takes_at_most_its_batches_and_the_next_waits(
    pipelined: bool, batches: int
) -> None:
    model = GatedEcho()
    model.gate = threading.Event()  # every forward waits until the gate opens
    inference = Inference(
        ModelRunner(model, device="cpu"), lambda _: None, pipelined=pipelined, batches=batches
    )
    done: list[Outcome] = []
    inference._on_done = done.append
    try:
        for n in range(batches):
            await asyncio.wait_for(inference.wait_for_slot(), 1.0)
            inference.submit(items([n]))
        waiting = asyncio.ensure_future(inference.wait_for_slot())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # full: the next batch keeps forming
        model.gate.set()
        await asyncio.wait_for(waiting, 5.0)  # a batch left the stage: room for the next
        inference.release_slot()
        await asyncio.wait_for(inference.wait_idle(), 5.0)
    finally:
        model.gate.set()
        inference.close()
    assert sorted(o for outcome in done for o in outcome.outputs) == list(range(batches))


@pytest.mark.parametrize(("batches", "partial", "takes"), [(4, None, 2), (4, 1, 1), (2, 3, 2)])
async def test_partial_batches_join_while_fewer_than_their_share_are_in_the_stage(
    batches: int, partial: int | None, takes: int
) -> None:
    model = GatedEcho()
    model.gate = threading.Event()
    inference = Inference(
        ModelRunner(model, device="cpu"),
        lambda _: None,
        pipelined=True,
        batches=batches,
        partial=partial,
    )
    try:
        for n in range(batches):
            assert inference.takes_partial() == (n < takes)
            await asyncio.wait_for(inference.wait_for_slot(), 1.0)
            inference.submit(items([n]))
        assert not inference.takes_partial()
        model.gate.set()
        await asyncio.wait_for(inference.wait_idle(), 5.0)
        assert inference.takes_partial()
    finally:
        model.gate.set()
        inference.close()


def test_a_stage_without_room_for_a_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="room for a batch"):
        Inference(ModelRunner(GatedEcho(), device="cpu"), lambda _: None, batches=0)


async def test_the_default_stage_holds_four_batches_pipelined_and_two_serially() -> None:
    for pipelined, expected in ((True, PIPELINED_SLOTS), (False, SLOTS)):
        inference = Inference(
            ModelRunner(GatedEcho(), device="cpu"), lambda _: None, pipelined=pipelined
        )
        try:
            for _ in range(expected):
                await asyncio.wait_for(inference.wait_for_slot(), 1.0)
            waiting = asyncio.ensure_future(inference.wait_for_slot())
            await asyncio.sleep(0.01)
            assert not waiting.done()
            waiting.cancel()
        finally:
            inference.close()


@pytest.mark.parametrize("pipelined", [False, True])
async def test_a_batch_decoded_where_the_model_runs_leaves_each_item_its_image(
    pipelined: bool,
) -> None:
    """With a next stage (``keep_images``), an item's JPEG decoded by the batch decoder is
    replaced by the image the model saw, so its crops need no second decode."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    from demo.models.detector import DigitsDetector
    from schemas import ContentType

    buffer = io.BytesIO()
    pixels = np.random.default_rng(5).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    detector = DigitsDetector(device="cpu", decode="gpu")
    batch = items([0, 0])
    for item in batch:
        item.tensor = detector.preprocess(buffer.getvalue(), ContentType.JPEG, {})
    runner = ModelRunner(detector, device="cpu", keep_images=True)
    inference = Inference(runner, lambda _: None, pipelined=pipelined)
    try:
        (outcome,) = await run_batches(inference, [batch])
    finally:
        inference.close()
    assert len(outcome.outputs) == 2
    for item in outcome.answered:
        assert item.tensor.shape == (3, 48, 80)  # decoded: (C, H, W), not the JPEG's bytes
        assert item.tensor.dtype == torch.uint8
