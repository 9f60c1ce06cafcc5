"""Model handlers: the plug-in point between the worker and a model.

A handler turns one payload into one tensor (``preprocess``, thread pool), a
stacked batch into outputs (``forward``, the model thread, on the device) and
outputs into one JSON-able result per item (``postprocess``). A handler may also
build the device batch itself (``Collating``), e.g. to decode JPEGs there, or to
hand a model that takes a list of images of different sizes (a detector) that list.
``ImageClassifier`` is the built-in handler behind classification specs, and
``ImageModel`` its fixed-size image input, shared with ``workers.handlers.tasks.embedding``;
the other tasks live in ``workers.handlers.tasks``. ``workers.model.loader`` builds handlers from
specs, and docs/models.md describes the protocol with a complete example.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from schemas import DEFAULT_LIMITS, ContentType, ContractError, ErrorCode, Limits
from workers.decode.budget import DecodeBudget
from workers.decode.gpu import BatchDecoder, DecodeOption, device_decode_supported
from workers.decode.images import ImageSpec, decode
from workers.decode.jpeg import JpegBackend

DEFAULT_TOP_K = 5

DeviceInput = torch.Tensor | list[torch.Tensor]
"""What ``Collating.collate`` may build: a stacked batch, or a list of per-item tensors
(for models that take images of different sizes)."""


@runtime_checkable
class Handler(Protocol):
    """What the worker needs from a model. Plain attributes satisfy the two properties."""

    @property
    def name(self) -> str:
        """The model's name, e.g. ``resnet50``."""

    @property
    def version(self) -> str:
        """What exactly answers, reported in every result: e.g. ``digits-cnn-v1`` or
        ``resnet50:random-weights`` (so a result says when its weights are random)."""

    def example_item(self) -> torch.Tensor:
        """One input as ``preprocess`` returns it (CPU); stacked to warm the model up."""

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        """Decode and check one payload to a CPU tensor: the model's item shape, or for a
        handler with ``collate``, whatever that takes (an image of its own size, say).

        Runs in a thread pool, so it must be thread-safe. Anything wrong with the
        payload or ``params`` raises ``ContractError`` (``decode_failed``,
        ``image_too_large``, ``unsupported_media_type``, ``bad_request``): checking
        ``params`` here fails only that request, never the batch it would join.
        """

    def forward(self, batch: Any) -> Any:
        """Run the model on a batch already on the model's device: the stacked items,
        or what the handler's ``collate`` built (``DeviceInput``).

        Called from a single thread under ``torch.inference_mode()``.
        """

    def postprocess(self, outputs: Any, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        """One JSON-able result per item, in batch order; ``params[i]`` belongs to item i.

        ``outputs`` is what ``forward`` returned, cut to the real items when the runner
        padded the batch (so it must be sliceable: a tensor or a list).
        """


@runtime_checkable
class Collating(Protocol):
    """Optional handler hook: build the device batch from preprocessed items.

    ``ModelRunner`` calls ``collate`` instead of stacking when a handler has it, so
    ``preprocess`` may return something cheaper than the model's input (encoded bytes,
    say) and the expensive part happens once per batch, on the device.
    """

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> DeviceInput | None:
        """The batch for ``forward`` on ``device``, items in order; ``None`` to let the
        runner stack ``items`` as usual (e.g. when none of them needs the hook). A list
        is passed to ``forward`` as it is: the runner neither stacks nor pads it.

        Called on the runner's staging stream, from one thread at a time. May raise
        ``ContractError`` for an item that turns out to be bad.
        """


@runtime_checkable
class Costed(Protocol):
    """Optional handler hook: what an item costs a batch per row, e.g. a text's padded
    length. The batcher then closes a batch at ``--max-batch-tokens`` (rows × the widest
    item's cost) and groups items of similar cost (``workers.batching.batcher``)."""

    def cost(self, item: torch.Tensor) -> int:
        """The cost of a row for ``item`` (as ``preprocess`` made it): 1 or more."""


@runtime_checkable
class WarmUpShapes(Protocol):
    """Optional handler hook: items of the other shapes a batch may take, beyond
    ``example_item``'s (a text model: one per length bucket). ``ModelRunner.warm_up``
    runs a batch of each when the forward is compiled, so that it traces them at start,
    not with the first request of that length."""

    def warm_up_items(self) -> list[torch.Tensor]:
        """One preprocessed item per shape to warm up."""


@runtime_checkable
class BatchPreprocess(Protocol):
    """Optional handler hook: ``preprocess`` for a chunk of payloads in one call (a fast
    tokenizer's batch call), in the decode threads as ``preprocess`` is."""

    def preprocess_batch(
        self,
        payloads: Sequence[bytes],
        content_types: Sequence[ContentType],
        params: Sequence[Mapping[str, Any]],
    ) -> list[torch.Tensor | ContractError]:
        """Per payload, its item or the ``ContractError`` that refuses it (never raised:
        one bad payload fails alone)."""


@runtime_checkable
class Exportable(Protocol):
    """Optional handler hook: ``forward`` as one ``torch.nn.Module``, for ahead-of-time
    compilation (``workers.model.packages``).

    The module must compute what ``forward`` does on a stacked batch, and every tensor
    it reads must be one of its parameters or buffers: a compiled package is kept
    without them and handed the module's own at each start.
    """

    def exportable(self) -> torch.nn.Module | None:
        """The module, or ``None`` when this handler's ``forward`` is not one."""


@runtime_checkable
class SplitPostprocess(Protocol):
    """Optional handler hook: ``postprocess`` in two halves, so that nothing waits for
    the device in the middle of a batch.

    ``postprocess_device`` runs right after ``forward``, on the device and the same
    stream, and returns small tensors (e.g. softmax and top-k); the runner copies them
    to pinned host memory without waiting. ``postprocess_host`` turns those host
    copies into the results once they have arrived, on another thread, while the
    device already runs the next batch. ``postprocess(outputs, params)`` must equal
    ``postprocess_host(postprocess_device(outputs, params) on the host, params)``.
    """

    def postprocess_device(
        self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]: ...

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]: ...


def to_host(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the host: from a GPU, each copied into pinned memory without
    waiting, then one wait for all of them (not a synchronizing copy per tensor)."""
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return tensors
    host = tuple(torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors)
    for to, source in zip(host, tensors, strict=True):
        to.copy_(source, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


def top_k_param(params: Mapping[str, Any], default: int = DEFAULT_TOP_K) -> int:
    """The ``top_k`` request parameter: a positive integer, ``default`` when absent."""
    value = params.get("top_k", default)
    # bool is an int subclass, but {"top_k": true} is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ContractError(
            ErrorCode.bad_request,
            "ce_params.top_k",
            "top_k must be a positive integer",
            seen=value,
        )
    return value


class ImageModel:
    """A ``torch.nn.Module`` that takes fixed-size images, minus the ``postprocess``.

    Items travel as uint8 (C, H, W) tensors fitted to ``image`` (``ImageSpec``: the
    ``fast`` or the ``reference`` preprocessing, docs/models.md); ``forward`` converts
    them to ``dtype``, normalizes them with ``mean``/``std`` on the device, and runs the
    module. Subclasses turn the module's outputs into results.

    With ``decode="gpu"`` (the ``auto`` choice on CUDA), a JPEG item travels as its
    encoded bytes (a 1-D uint8 tensor, its declared size already checked) and
    ``collate`` decodes the batch's JPEGs on the device with nvJPEG; other images,
    and JPEGs the device decoder will not take, are decoded on the CPU as before.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        image: ImageSpec,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        set_eval: bool = True,
        decode: DecodeOption = "auto",
        decode_budget: DecodeBudget | None = None,
    ) -> None:
        """Wrap ``module``, moving it to ``device`` and ``dtype``.

        ``set_eval=False`` is for ``torch.export`` modules, whose train/eval mode is
        fixed when they are exported and which refuse ``.eval()``. ``decode`` picks
        where images are decoded (``workers.decode.gpu.DecodeOption``); ``gpu`` on a
        CPU device runs the same batched path with torchvision's CPU decoder (for tests).
        ``decode_budget`` bounds the memory of CPU decodes running at once, over all
        threads (``workers.decode.images.DecodeBudget``).
        Raises ``ValueError`` for ``decode="gpu"`` where the batched path cannot fit
        images the way ``image`` says.
        """
        if len(mean) != image.channels or len(std) != image.channels:
            raise ValueError(
                f"mean and std need {image.channels} values for {image.mode} input, "
                f"got {len(mean)} and {len(std)}"
            )
        self.name = name
        self.version = version
        self.image = image
        self.device = torch.device(device)
        self.dtype = dtype
        self._limits = limits
        self.decode_budget = decode_budget
        """Bounds the memory of CPU decodes running at once (shared by the threads)."""
        module = module.to(device=self.device, dtype=dtype)
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        if set_eval:
            module.eval()
        self.module = module
        self._network = Normalized(module, mean, std, channels_last=channels_last).to(
            self.device, dtype
        )
        self.batch_decoder = _batch_decoder(decode, image, self.device, limits)
        """The device JPEG path, or ``None`` when every image is decoded on the CPU."""

    def example_item(self) -> torch.Tensor:
        if self.batch_decoder is not None:
            return self.batch_decoder.example()  # so that warm-up starts nvJPEG too
        return torch.zeros(
            (self.image.channels, self.image.height, self.image.width), dtype=torch.uint8
        )

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Raise ``ContractError(bad_request)`` for request parameters this model refuses."""

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        self.check_params(params)
        on_device = self._on_device(payload, content_type)
        if on_device is not None:
            return on_device
        return decode(
            payload,
            content_type,
            self.image,
            max_pixels=self._limits.max_pixels,
            budget=self.decode_budget,
        )

    def _on_device(self, payload: bytes, content_type: ContentType) -> torch.Tensor | None:
        """The payload for the batch decoder to decode or fit on the device (a JPEG still
        encoded, a ``.npy`` array's raw pixels), or ``None`` for the CPU path."""
        if self.batch_decoder is None:
            return None
        if content_type == ContentType.JPEG:
            return self.batch_decoder.encoded(payload)
        if content_type == ContentType.NPY:
            return self.batch_decoder.raw(payload)
        return None

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
        if self.batch_decoder is None:
            return None
        return self.batch_decoder.collate(items, device)

    def normalize(self, batch: torch.Tensor) -> torch.Tensor:
        """uint8 (N, C, H, W) pixels to the module's normalized input (device, dtype, layout)."""
        return self._network.normalize(batch.to(self.device))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self._network(batch.to(self.device))
        return outputs

    def exportable(self) -> torch.nn.Module | None:
        """The normalization and the module, unless a subclass changed ``forward``."""
        return self._network if type(self).forward is ImageModel.forward else None


class Normalized(torch.nn.Module):
    """uint8 (N, C, H, W) pixels, normalized with ``mean`` and ``std``, into ``module``.

    The normalization runs in the dtype of the module (``.to`` moves both), as one
    multiply-subtract: ``(pixels / 255 - mean) / std = pixels * scale - shift``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.training = False  # only this wrapper: exported modules refuse .eval()
        self.module = module
        self.channels_last = channels_last
        shape = (1, len(mean), 1, 1)
        std_t = torch.tensor(std, dtype=torch.float64).view(shape)
        mean_t = torch.tensor(mean, dtype=torch.float64).view(shape)
        self.scale: torch.Tensor
        self.shift: torch.Tensor
        self.register_buffer("scale", 1.0 / (255.0 * std_t), persistent=False)
        self.register_buffer("shift", mean_t / std_t, persistent=False)

    def normalize(self, batch: torch.Tensor) -> torch.Tensor:
        # Out of place: a batch already in the dtype must not be changed under the caller.
        x = batch.to(self.scale.dtype) * self.scale - self.shift
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        outputs: torch.Tensor = self.module(self.normalize(batch))
        return outputs


class ImageClassifier(ImageModel):
    """An image classification ``torch.nn.Module`` served as a handler.

    Results are the ``top_k`` classes (request parameter, default ``default_top_k``,
    capped at the number of labels) as ``{"label", "index", "score"}`` with softmax
    scores, best first. See ``ImageModel`` for the input side.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name: str,
        version: str,
        labels: Sequence[str],
        image: ImageSpec,
        mean: Sequence[float],
        std: Sequence[float],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        default_top_k: int = DEFAULT_TOP_K,
        set_eval: bool = True,
        decode: DecodeOption = "auto",
        decode_budget: DecodeBudget | None = None,
    ) -> None:
        """See ``ImageModel``; ``labels`` names the module's output classes, in order."""
        if not labels:
            raise ValueError("an image classifier needs at least one label")
        super().__init__(
            module,
            name=name,
            version=version,
            image=image,
            mean=mean,
            std=std,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            set_eval=set_eval,
            decode=decode,
            decode_budget=decode_budget,
        )
        self.labels: tuple[str, ...] = tuple(labels)
        self._default_top_k = default_top_k

    def check_params(self, params: Mapping[str, Any]) -> None:
        top_k_param(params, self._default_top_k)

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        device = self.postprocess_device(outputs, params)
        return self.postprocess_host(to_host(device), params)

    def postprocess_device(
        self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """Softmax and top-k for the whole batch on the device: (scores, indices), each
        (batch, largest k asked for)."""
        if outputs.ndim != 2 or outputs.shape[1] != len(self.labels):
            raise RuntimeError(
                f"{self.name} returned outputs of shape {tuple(outputs.shape)}; "
                f"expected (batch, {len(self.labels)}), one score per label"
            )
        k = max((self._top_k(p) for p in params), default=1)
        scores, indices = outputs.float().softmax(dim=-1).topk(k, dim=-1)
        return scores, indices

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The top-k lists per item from ``postprocess_device``'s host copies."""
        if not params:
            return []
        scores, indices = tensors
        labels = self.labels
        results: list[Any] = []
        for p, item_scores, item_indices in zip(
            params, scores.tolist(), indices.tolist(), strict=True
        ):
            k = self._top_k(p)
            results.append(
                [
                    {"label": labels[i], "index": i, "score": s}
                    for s, i in zip(item_scores[:k], item_indices[:k], strict=True)
                ]
            )
        return results

    def _top_k(self, params: Mapping[str, Any]) -> int:
        return min(top_k_param(params, self._default_top_k), len(self.labels))


def _batch_decoder(
    decode: DecodeOption, image: ImageSpec, device: torch.device, limits: Limits
) -> BatchDecoder | None:
    if decode not in ("auto", "cpu", "gpu", "gpu-hw"):
        raise ValueError(f"decode must be auto, cpu, gpu or gpu-hw, not {decode!r}")
    if decode == "cpu":
        return None
    # auto: the device path only pays off on CUDA, and only where it fits images the way
    # Pillow would (a model that wants Lanczos resampling keeps the CPU path).
    if decode == "auto" and (device.type != "cuda" or device_decode_supported(image) is not None):
        return None
    backend: JpegBackend = "nvimgcodec" if decode == "gpu-hw" else "nvjpeg"
    return BatchDecoder(image, max_pixels=limits.max_pixels, backend=backend)
