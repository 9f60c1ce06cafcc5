"""bench.identity: the model that costs nothing, with small results or large ones."""

from __future__ import annotations

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
