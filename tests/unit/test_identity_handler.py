"""bench.identity: the model that costs nothing, with small results or large ones; and
bench.paced, the same model taking a set time a batch."""

from __future__ import annotations

import pytest
import torch

from schemas import DEFAULT_LIMITS, ContentType
from workers.model.loader import load_handler


def identity(**options: object) -> object:
    return load_handler("bench.identity:IdentityHandler", device="cpu", weights=None,
                        dtype="auto", channels_last=None, limits=DEFAULT_LIMITS,
                        options=options)  # fmt: skip


def test_results_echo_the_payloads_head_or_carry_as_many_bytes_as_asked() -> None:
    small = identity()
    item = small.preprocess(b"abc", ContentType.TEXT, {})  # type: ignore[attr-defined]
    batch = torch.stack([item, item])
    assert small.postprocess(batch, [{}, {}]) == [[97, 98, 99] + [0] * 13] * 2  # type: ignore[attr-defined]

    large = identity(result_bytes=10924)
    [result] = large.postprocess(batch[:1], [{}])  # type: ignore[attr-defined]
    assert result["head"][:3] == [97, 98, 99]
    assert len(result["data"]) == 10924


def test_the_paced_model_answers_as_the_identity_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_PACED_BATCH_MS", "1")
    paced = load_handler("bench.paced:PacedHandler", device="cpu", weights=None, dtype="auto",
                         channels_last=None, limits=DEFAULT_LIMITS)  # fmt: skip
    item = paced.preprocess(b"abc", ContentType.TEXT, {})
    assert paced.postprocess(paced.forward(torch.stack([item])), [{}]) == [[97, 98, 99] + [0] * 13]
