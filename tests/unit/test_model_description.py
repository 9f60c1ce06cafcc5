"""What a worker says about its model (``workers.model.description``): the task from
the handler's type, the media types it decodes, its version; and the document's trip
through its wire form (``schemas.description``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from schemas import ContentType, ContractError
from schemas.description import (
    Task,
    decode_description,
    description_key,
    encode_description,
)
from tests.unit.test_handlers import Identity, classifier
from workers.generation.loading import Generator, StreamOptions
from workers.generation.requests import Limits
from workers.handlers import ImageEmbedder, ImageSpec
from workers.model.description import describe


class TextHandler:
    """A user's handler that says what it takes."""

    name = "echo"
    version = "echo-v2"
    content_types = ("text/plain",)

    def example_item(self) -> torch.Tensor:
        return torch.zeros(1)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.zeros(1)

    def forward(self, batch: Any) -> Any:
        return batch

    def postprocess(self, outputs: Any, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [None] * len(params)


def test_a_classifier_is_described_with_its_labels_and_image_types() -> None:
    described = describe(classifier(Identity()), "digits", "w-1")
    assert (described.name, described.version, described.task) == (
        "digits",
        "test-v1",
        Task.classification,
    )
    assert described.labels == len(classifier(Identity()).labels)
    assert set(described.content_types) == {
        ContentType.JPEG,
        ContentType.PNG,
        ContentType.WEBP,
        ContentType.NPY,
    }
    assert decode_description(encode_description(described)) == described


def test_an_embedder_and_a_users_handler() -> None:
    embedder = ImageEmbedder(
        Identity(),
        name="e",
        version="e-v1",
        image=ImageSpec(4, 4, "RGB"),
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
    )
    assert describe(embedder, "e", "w").task == Task.embedding
    assert describe(embedder, "e", "w").labels is None
    custom = describe(TextHandler(), "echo", "w")
    assert (custom.task, custom.content_types) == (Task.custom, ("text/plain",))


def test_garbage_is_a_contract_error() -> None:
    assert description_key("digits") == "conveyor:model:digits"
    with pytest.raises(ContractError, match="description"):
        decode_description(b'{"name": "x"}')


def test_a_generation_model_is_described_as_text_generation() -> None:
    """A causal LM's handler (``Generator``): task ``text_generation``, text and JSON
    (the gateway's ``/v1/models`` lists the models so described)."""
    model = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    limits = Limits(
        max_prompt_tokens=8, max_new_tokens=4, default_new_tokens=2, max_total_tokens=12
    )
    generator = Generator(
        "tiny", model, SimpleNamespace(), cast(Any, None), limits, StreamOptions()
    )
    described = describe(generator, "tiny", "w")
    assert (described.task, described.labels) == (Task.text_generation, None)
    assert set(described.content_types) == {ContentType.TEXT, ContentType.JSON}
    assert decode_description(encode_description(described)).task == Task.text_generation
