"""The model runner: stacks a micro-batch, runs the handler on the device, splits results.

Synchronous by design: the worker calls ``run`` from one dedicated thread, so
the device sees one batch at a time while the event loop keeps fetching,
decoding and publishing around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from workers.handlers import Handler


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` → the first GPU if torch sees one, else the CPU; ``cuda[:N]`` is checked.

    Raises ``ValueError`` saying what to pass instead when the device does not exist.
    """
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} needs a GPU, but torch sees none (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); use --device cpu, or auto to take a GPU when "
            "there is one"
        )
    index = 0 if resolved.index is None else resolved.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"device {device!r} does not exist: torch sees {count} GPU(s), cuda:0 to "
            f"cuda:{count - 1} (CUDA_VISIBLE_DEVICES renumbers them)"
        )
    return torch.device("cuda", index)


class ModelRunner:
    """Runs one handler's model on one device, a batch at a time."""

    def __init__(
        self, handler: Handler, device: str | torch.device = "auto", *, compile: bool = False
    ) -> None:
        """``device`` must be the one the handler's model was loaded on (``auto`` resolves
        the same way for both). ``compile`` wraps ``handler.forward`` in ``torch.compile``;
        the first batch of each new size then compiles, which ``warm_up`` moves to start-up.
        """
        self.handler = handler
        self.device = resolve_device(device)
        self._forward: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(handler.forward) if compile else handler.forward
        )

    def run(
        self, tensors: Sequence[torch.Tensor], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """Outputs for a batch: ``result[i]`` answers ``tensors[i]`` with ``params[i]``.

        Exceptions from the model propagate (``torch.cuda.OutOfMemoryError`` included),
        so the caller can split the batch and retry the halves.
        """
        if len(tensors) != len(params):
            raise ValueError(f"{len(tensors)} tensors but {len(params)} params; need one each")
        if not tensors:
            return []
        batch = self._stack(tensors).to(self.device, non_blocking=True)
        with torch.inference_mode():
            outputs = self._forward(batch)
            # postprocess copies results to the host, which also waits for the
            # non-blocking upload above to finish before its pinned buffer is freed.
            results = self.handler.postprocess(outputs, params)
        if len(results) != len(tensors):
            raise RuntimeError(
                f"handler {self.handler.name} returned {len(results)} results "
                f"for a batch of {len(tensors)}; postprocess must return one per item"
            )
        return results

    def warm_up(self, batch_sizes: Iterable[int]) -> None:
        """Run a dummy batch of each size, so that allocator growth, cuDNN algorithm
        choice and compilation happen before the first real request."""
        item = self.handler.example_item()
        for size in sorted(set(batch_sizes)):
            if size < 1:
                raise ValueError(f"warm-up batch sizes must be at least 1, got {size}")
            self.run([item] * size, [{}] * size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.stack(list(tensors))
        # Stack straight into page-locked memory: the upload can then be asynchronous
        # and skips the driver's staging copy. Torch caches pinned blocks, so this
        # allocation is cheap after the first batches.
        first = tensors[0]
        out = torch.empty((len(tensors), *first.shape), dtype=first.dtype, pin_memory=True)
        return torch.stack(list(tensors), out=out)
