"""Image embeddings: a classification backbone without its head, one vector per image.

``ImageEmbedder`` takes images exactly as ``ImageClassifier`` does (the same
``ImageModel`` input side, ``fast`` or ``reference`` preprocessing, CPU or nvJPEG
decoding) and answers with the module's output for each image, flattened: for a
torchvision classifier whose last linear layer was replaced by an identity
(``remove_head``), the pooled features the classifier would have scored (2048 values
for ResNet-50). Requests choose L2 normalization (on by default) and float32 or
float16 output; results are ``conveyor.embedding.v1`` documents.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from schemas.outputs import EMBEDDING_V1
from workers.handlers.base import ImageModel, to_host
from workers.handlers.tasks.params import EmbeddingParams

_WIRE_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
_TINY = float(np.finfo(np.float32).tiny)


class ImageEmbedder(ImageModel):
    """An image model whose output is the embedding (see the module doc)."""

    def check_params(self, params: Mapping[str, Any]) -> None:
        EmbeddingParams.parse(params)

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        device = self.postprocess_device(outputs, params)
        return self.postprocess_host(to_host(device), params)

    def postprocess_device(
        self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """The batch's outputs as float32: ((batch, *shape),). The runner copies
        them to the host without waiting for the device, which then runs the next batch
        while the host encodes these (a copy that waited held each batch's encoding and
        the next batch's start apart)."""
        return (outputs.float(),)

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The embedding documents from ``postprocess_device``'s host copy."""
        if not params:
            return []
        (outputs,) = tensors
        shape = [int(size) for size in outputs.shape[1:]]
        vectors = outputs.reshape(len(outputs), -1).numpy()
        return [
            embedding_document(vector, shape, EmbeddingParams.parse(p))
            for vector, p in zip(vectors, params, strict=True)
        ]


def embedding_document(
    vector: np.ndarray[Any, Any], shape: list[int], params: EmbeddingParams
) -> dict[str, Any]:
    """One ``conveyor.embedding.v1`` document: ``vector`` normalized if asked, cast, base64."""
    if params.normalize:
        norm = float(np.sqrt(np.dot(vector.astype(np.float64), vector)))
        # A zero vector stays zero rather than becoming NaNs.
        vector = vector / np.float32(max(norm, _TINY))
    data = vector.astype(_WIRE_DTYPES[params.dtype]).tobytes()
    return {
        "type": EMBEDDING_V1,
        "dtype": params.dtype,
        "shape": shape,
        "normalized": params.normalize,
        "data": base64.b64encode(data).decode("ascii"),
    }


def remove_head(module: torch.nn.Module, classes: int) -> torch.nn.Module:
    """Replace ``module``'s classification head, the last ``torch.nn.Linear`` with
    ``classes`` outputs, by an identity, in place; returns ``module``.

    Raises ``ValueError`` when it has none (a model that scores with a convolution,
    such as SqueezeNet): such a model has no embedding this can find.
    """
    head = None
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear) and child.out_features == classes:
            head = name
    if head is None:
        raise ValueError(f"it has no linear layer with {classes} outputs to remove")
    parent_name, _, attribute = head.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, attribute, torch.nn.Identity())
    return module
