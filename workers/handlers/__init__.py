"""The handler API: everything a model plug-in needs, from one place.

A handler turns payloads into tensors, runs the model and turns its outputs into
result documents (docs/models.md "Writing a handler"). Serve one with
``conveyor worker --model my.module:MyHandler``; import what it uses from here::

    from workers.handlers import Handler, ImageClassifier, ImageSpec, decode

Only the names in ``__all__`` are the public API: they keep their meaning across
releases. The modules behind them (``workers.handlers.base``, ``workers.decode``,
``workers.handlers.tasks``...) may move.
"""

from __future__ import annotations

from workers.config.worker import MODEL_DIR_VARIABLE
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import DecodeOption
from workers.decode.images import ImageSpec, decode, decode_full
from workers.handlers.base import (
    DEFAULT_TOP_K,
    Collating,
    DeviceInput,
    Exportable,
    Handler,
    ImageClassifier,
    ImageModel,
    SplitPostprocess,
    top_k_param,
)
from workers.handlers.published import DEFAULT_WEIGHTS
from workers.handlers.tasks.detection import Detector
from workers.handlers.tasks.embedding import ImageEmbedder
from workers.handlers.tasks.segmentation import SemanticSegmenter
from workers.handlers.weights import RANDOM_WEIGHTS, ModelLoadError

__all__ = [
    "DEFAULT_TOP_K",
    "DEFAULT_WEIGHTS",
    "MODEL_DIR_VARIABLE",
    "RANDOM_WEIGHTS",
    "Collating",
    "DecodeBudget",
    "DecodeOption",
    "Detector",
    "DeviceInput",
    "Exportable",
    "Handler",
    "ImageClassifier",
    "ImageEmbedder",
    "ImageModel",
    "ImageSpec",
    "ModelLoadError",
    "SemanticSegmenter",
    "SplitPostprocess",
    "decode",
    "decode_full",
    "top_k_param",
]
