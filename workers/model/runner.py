"""The model runner: stages a micro-batch on the device, runs the handler, splits results.

Synchronous by design: the worker calls ``run`` from one dedicated thread, so
the device sees one batch at a time while the event loop keeps fetching,
decoding and publishing around it. ``run`` is ``prepare`` (stack into pinned
memory and copy, or the handler's ``collate``, on a CUDA stream of its own) then
``infer`` (the forward on the compute stream): a caller that prepares the next
batch from another thread while one is inferring overlaps the two on the GPU.

With ``buckets``, a batch is padded up to the next bucket size and the padding
stripped from the outputs, so a compiled model sees a few fixed shapes, each
compiled during ``warm_up`` rather than by the first request of that size.

A handler's ``collate`` may build a list of per-item tensors instead of one stacked
batch (detectors take images of different sizes): the list goes to ``forward`` as
it is, never padded nor graph-captured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from workers.decode.cuda_sync import event as cuda_event
from workers.handlers.base import (
    Collating,
    DeviceInput,
    Exportable,
    Handler,
    SplitPostprocess,
    WarmUpShapes,
)
from workers.model.packages import packaged_forward

log = logging.getLogger(__name__)

DEFAULT_SMALLEST_BUCKET = 8
"""On a GPU a batch of 8 costs about what a batch of 1 does, and every bucket is one
more compilation at start-up; padding small batches up to 8 is the better trade."""


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


def batch_buckets(
    max_batch_size: int, smallest: int = DEFAULT_SMALLEST_BUCKET, step: int | None = None
) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_batch_size``, then ``max_batch_size``:
    e.g. 8, 16, 32, 64, 128, 256 for 256, and 8, 16, 32, 64, 100 for 100. With ``step``,
    also every multiple of ``step`` below the maximum, so that padding a batch up to its
    bucket never adds more than ``step`` rows (8, 16, 32, 64, 96, 128, ... for 32)."""
    if max_batch_size < 1 or smallest < 1 or (step is not None and step < 1):
        raise ValueError(f"batch sizes must be at least 1, got {max_batch_size} and {smallest}")
    sizes = {max_batch_size}
    size = 1
    while size < max_batch_size:
        if size >= smallest:
            sizes.add(size)
        size *= 2
    if step is not None:
        sizes.update(range(step, max_batch_size, step))
    return tuple(sorted(sizes))


CompileForm = Literal["package", "static", "dynamic"]
"""How the forward is compiled (``ModelRunner``'s ``compile``, ``--compile-form``)."""

WARM_UP_SHAPE_ROWS = 2
"""Rows of the warm-up batch of each of a ``WarmUpShapes`` handler's shapes: past one, which
a compiled forward specializes on."""

GRAPH_BUCKET_STEP = 32
"""Rows a CUDA graph bucket may pad a batch by, at most (see ``batch_buckets``)."""


@dataclass(frozen=True, slots=True)
class Launched:
    """A batch the model is running (``ModelRunner.launch``), to ``finish`` later."""

    size: int
    params: Sequence[Mapping[str, Any]]
    host: tuple[torch.Tensor, ...] | None  # SplitPostprocess outputs (pinned, on CUDA)
    results: list[Any] | None  # final already: a handler without SplitPostprocess
    copied: torch.cuda.Event | None  # recorded once ``host`` holds the outputs
    started: torch.cuda.Event | None  # timing events around the device work (CUDA)
    ended: torch.cuda.Event | None
    images: list[torch.Tensor] | None = None
    """With ``keep_images``: each item's image as the model saw it, uint8 (C, H, W) on the
    host (a list batch's; on CUDA, copied into pinned memory by ``copied``)."""

    def device_seconds(self) -> float | None:
        """Device time of the forward and postprocess (CUDA, after ``finish``)."""
        if self.started is None or self.ended is None:
            return None
        return float(self.started.elapsed_time(self.ended)) / 1000.0


@dataclass(frozen=True, slots=True)
class DeviceBatch:
    """A batch staged on the device by ``ModelRunner.prepare``, ready for ``infer``."""

    tensor: DeviceInput  # the model's input: stacked and padded up to its bucket, or a list
    size: int  # the real items; rows past them are padding
    ready: torch.cuda.Event | None  # recorded on the staging stream once the data is there


class ModelRunner:
    """Runs one handler's model on one device, a batch at a time."""

    def __init__(
        self,
        handler: Handler,
        device: str | torch.device = "auto",
        *,
        compile: CompileForm | None = None,
        packages: Path | None = None,
        buckets: Sequence[int] = (),
        cuda_graphs: bool = False,
        keep_images: bool = False,
    ) -> None:
        """``device`` must be the one the handler's model was loaded on (``auto`` resolves
        the same way for both). ``compile`` compiles ``handler.forward``: ``static`` and
        ``dynamic`` wrap it in ``torch.compile`` (``compile_forward``), whose first batch
        of each new size then compiles, which ``warm_up`` moves to start-up; ``package``
        compiles the forward of each bucket ahead of time into a package kept in the
        folder ``packages`` (``workers.model.packages``) during ``warm_up``, where the
        handler is ``Exportable`` and there are buckets, else it falls back to ``static``.
        ``buckets`` (e.g. ``batch_buckets(256)``) pads each batch to the next bucket size;
        the handler's forward must treat batch rows independently (eval-mode models do).
        ``cuda_graphs`` (CUDA, with buckets) records the forward of each bucket size as a
        CUDA graph during ``warm_up`` and replays it: one call per batch instead of one
        per operator, so the launching thread hardly needs the GIL (with other busy
        threads in the process, every reacquisition can wait a switch interval).
        ``keep_images`` (a next stage cuts crops from them, ``workers.chain``): where a
        batch is a list of images decoded on the device at their own sizes, ``launch``
        copies them back to the host after the forward (``Launched.images``), so that
        nothing decodes them again on the CPU.
        """
        if any(size < 1 for size in buckets):
            raise ValueError(f"bucket sizes must be at least 1, got {sorted(buckets)}")
        self.handler = handler
        self.device = resolve_device(device)
        self.buckets: tuple[int, ...] = tuple(sorted(set(buckets)))
        self._forward: Callable[[Any], Any] = handler.forward
        self._compiled = compile is not None  # by torch.compile or into packages
        exportable = handler.exportable() if isinstance(handler, Exportable) else None
        self._to_package: tuple[torch.nn.Module, Path] | None = None
        if compile == "package" and packages is not None and exportable is not None and buckets:
            self._to_package = (exportable, packages)  # built in warm_up, from its batches
        elif compile is not None:
            if compile == "package":
                log.info(
                    "compiling %s with torch.compile%s: packages need a handler with "
                    "exportable() and fixed batch sizes",
                    handler.name,
                    "" if self.buckets else " (dynamic shapes)",
                )
            self._forward = compile_forward(handler.forward, self.buckets, compile == "dynamic")
        self._collate = handler.collate if isinstance(handler, Collating) else None
        self._split = handler if isinstance(handler, SplitPostprocess) else None
        self._want_graphs = cuda_graphs and self.device.type == "cuda" and bool(self.buckets)
        self._keep_images = keep_images
        self._graphs: dict[tuple[int, ...], _Graph] = {}  # by input shape
        # Uploads (and device-side decoding) run on one stream and the model on another,
        # so that a batch prepared from one thread overlaps the forward launched from
        # another. torch.cuda.Stream and Event have no annotations in torch's sources.
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._compute = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]

    def run(
        self, tensors: Sequence[torch.Tensor], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """Outputs for a batch: ``result[i]`` answers ``tensors[i]`` with ``params[i]``.

        Exceptions from the model propagate (``torch.cuda.OutOfMemoryError`` included),
        so the caller can split the batch and retry the halves; so do ``ContractError``s
        from a handler's ``collate`` that finds an item bad.
        """
        if len(tensors) != len(params):
            raise ValueError(f"{len(tensors)} tensors but {len(params)} params; need one each")
        if not tensors:
            return []
        return self.infer(self.prepare(tensors), params)

    def prepare(self, tensors: Sequence[torch.Tensor]) -> DeviceBatch:
        """Stage preprocessed items on the device: the handler's ``collate``, else a stack
        through pinned memory; padded to the bucket. Safe to call from another thread
        than ``infer``'s, one thread at a time. ``tensors`` must not be empty."""
        if not tensors:
            raise ValueError("cannot prepare an empty batch")
        with torch.inference_mode(), self._staging():
            batch = self._collate(tensors, self.device) if self._collate is not None else None
            if batch is None:
                batch = self._upload(tensors)
            if isinstance(batch, torch.Tensor):
                batch = self._pad(batch)
            ready = None
            if self._stream is not None:
                ready = cuda_event()
                ready.record(self._stream)
        return DeviceBatch(batch, len(tensors), ready)

    def infer(self, batch: DeviceBatch, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Run the model on a prepared batch; one result per real item, padding dropped."""
        return self.finish(self.launch(batch, params))

    def launch(self, batch: DeviceBatch, params: Sequence[Mapping[str, Any]]) -> Launched:
        """Start the model on a prepared batch, on the compute stream, without waiting.

        With a ``SplitPostprocess`` handler the device half of postprocess runs too and
        its small outputs are copied to pinned host memory asynchronously; ``finish``
        waits for them (from another thread, if the caller likes: the device can run
        the next batch meanwhile). Other handlers' ``postprocess`` runs here, as before.
        """
        if batch.size != len(params):
            raise ValueError(f"{batch.size} items but {len(params)} params; need one each")
        cuda = self._compute is not None
        with torch.inference_mode(), self._computing():
            if batch.ready is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_event(batch.ready)
                # The batch was allocated on the staging stream: keep the allocator from
                # handing its memory out again before the forward here has read it.
                for tensor in _tensors(batch.tensor):
                    tensor.record_stream(compute)
            started = _event(cuda)
            stacked = batch.tensor if isinstance(batch.tensor, torch.Tensor) else None
            graph = self._graphs.get(tuple(stacked.shape)) if stacked is not None else None
            if stacked is not None and graph is not None and graph.takes(stacked):
                outputs = graph.run(stacked)[: batch.size]
            else:
                outputs = self._forward(batch.tensor)[: batch.size]
            images = self._images_back(batch) if self._keep_images else None
            if self._split is None:
                results = self.handler.postprocess(outputs, params)
                ended = _event(cuda)
                copied = ended if images is not None else None
                return Launched(batch.size, params, None, results, copied, started, ended, images)
            device = self._split.postprocess_device(outputs, params)
            if not cuda:
                return Launched(batch.size, params, device, None, None, None, None, images)
            host = tuple(torch.empty_like(t, device="cpu", pin_memory=True) for t in device)
            for to, source in zip(host, device, strict=True):
                to.copy_(source, non_blocking=True)
            ended = _event(cuda)
        return Launched(batch.size, params, host, None, ended, started, ended, images)

    def _images_back(self, batch: DeviceBatch) -> list[torch.Tensor] | None:
        """A list batch's images on the host, copied after the forward on its stream (on
        CUDA, into pinned memory, without waiting); ``None`` for a stacked batch."""
        if isinstance(batch.tensor, torch.Tensor):
            return None
        images = batch.tensor[: batch.size]
        if self.device.type != "cuda":
            return [image if image.device.type == "cpu" else image.cpu() for image in images]
        host = [torch.empty_like(image, device="cpu", pin_memory=True) for image in images]
        for to, image in zip(host, images, strict=True):
            to.copy_(image, non_blocking=True)
        return host

    def finish(self, launched: Launched) -> list[Any]:
        """The results of a launched batch, once its outputs are on the host."""
        if launched.copied is not None:
            launched.copied.synchronize()  # releases the GIL while it waits
        if launched.results is not None:
            results = launched.results
        else:
            assert self._split is not None
            assert launched.host is not None
            with torch.inference_mode():
                results = self._split.postprocess_host(launched.host, launched.params)
        if len(results) != launched.size:
            raise RuntimeError(
                f"handler {self.handler.name} returned {len(results)} results "
                f"for a batch of {launched.size}; postprocess must return one per item"
            )
        return results

    def warm_up(self, batch_sizes: Iterable[int] = ()) -> None:
        """Run a dummy batch of each size, and of every bucket, so that allocator growth,
        cuDNN algorithm choice, nvJPEG start-up and compilation happen before the first
        real request. Sizes that pad to the same bucket run once."""
        item = self.handler.example_item()
        sizes = set(batch_sizes)
        if any(size < 1 for size in sizes):
            raise ValueError(f"warm-up batch sizes must be at least 1, got {min(sizes)}")
        if self._to_package is not None:
            self._forward = self._packaged(item, *self._to_package)
            self._to_package = None
        for size in sorted({self._bucket(size) for size in sizes} | set(self.buckets)):
            self.run([item] * size, [{}] * size)
        # Only a compiled forward traces a new shape; an eager one meets it as cheaply later.
        if isinstance(self.handler, WarmUpShapes) and self._compiled:
            for shaped in self.handler.warm_up_items():
                self.run([shaped] * WARM_UP_SHAPE_ROWS, [{}] * WARM_UP_SHAPE_ROWS)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._want_graphs and not self._graphs:
            self._capture(item)

    def _packaged(
        self, item: torch.Tensor, module: torch.nn.Module, folder: Path
    ) -> Callable[[Any], Any]:
        """The forward through a package per bucket, else ``torch.compile``'s (logged)."""

        def example(size: int) -> torch.Tensor:
            batch = self.prepare([item] * size)
            if batch.ready is not None:
                batch.ready.synchronize()
            if not isinstance(batch.tensor, torch.Tensor):
                raise TypeError("this handler's batches are lists of images")
            return batch.tensor

        forward = packaged_forward(module, self.buckets, example, folder)
        if forward is not None:
            return forward
        return compile_forward(self.handler.forward, self.buckets)

    @property
    def graphed_sizes(self) -> tuple[int, ...]:
        """Batch sizes whose forward replays a CUDA graph."""
        return tuple(sorted(shape[0] for shape in self._graphs))

    def _capture(self, item: torch.Tensor) -> None:
        """Record one CUDA graph per bucket (sharing one memory pool: replays never
        overlap, they run on the compute stream one after another). A handler whose
        forward cannot be captured (it synchronises, or changes shape with its input)
        keeps running eagerly, with a warning."""
        assert self._compute is not None
        pool = torch.cuda.graph_pool_handle()
        try:
            for size in self.buckets:
                example = self.prepare([item] * size)
                assert example.ready is not None
                example.ready.synchronize()
                if not isinstance(example.tensor, torch.Tensor):
                    log.info("CUDA graphs are off: this handler's batches are lists of images")
                    return
                static = static_input(example.tensor)
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    torch.cuda.graph(graph, pool=pool, stream=self._compute),
                ):
                    output = self._forward(static)
                self._graphs[tuple(static.shape)] = _Graph(graph, static, output)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a model that cannot be captured still serves, eagerly
            self._graphs.clear()
            log.warning("CUDA graphs are off: capturing the forward failed (%r)", exc)

    def _staging(self) -> AbstractContextManager[Any]:
        return nullcontext() if self._stream is None else torch.cuda.stream(self._stream)

    def _computing(self) -> AbstractContextManager[Any]:
        return nullcontext() if self._compute is None else torch.cuda.stream(self._compute)

    def _bucket(self, size: int) -> int:
        """The smallest bucket that holds ``size`` items; ``size`` itself above them all."""
        return next((bucket for bucket in self.buckets if bucket >= size), size)

    def _pad(self, batch: torch.Tensor) -> torch.Tensor:
        padding = self._bucket(len(batch)) - len(batch)
        if padding == 0:
            return batch
        return torch.cat([batch, batch.new_zeros((padding, *batch.shape[1:]))])

    def _upload(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.stack(list(tensors))
        # Stack straight into page-locked memory: the upload can then be asynchronous
        # and skips the driver's staging copy. Torch caches pinned blocks and keeps each
        # one until the copies that read it are done, so dropping it here is safe.
        first = tensors[0]
        host = torch.empty((len(tensors), *first.shape), dtype=first.dtype, pin_memory=True)
        torch.stack(list(tensors), out=host)
        return host.to(self.device, non_blocking=True)


def compile_forward(
    forward: Callable[[torch.Tensor], torch.Tensor],
    buckets: Sequence[int],
    dynamic_batch: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile(forward)``: one static graph per bucket size when there are
    buckets, else one graph with dynamic shapes (a text model's batches).

    ``dynamic_batch`` marks the batch dimension of every tensor batch dynamic instead,
    so one graph serves every size. Inductor may still guard it (ResNet-50's kernels
    differ below 16 rows), which makes two graphs, not one a bucket. A start with a
    warm compile cache traces each graph once before the cache hands back its code, so
    fewer graphs start sooner (docs/bench-log/2026-11-27-compile-warm-start.md)."""
    config = torch._dynamo.config
    if dynamic_batch:
        config.recompile_limit = max(config.recompile_limit, 4)
        compiled = torch.compile(forward)

        def forward_any_batch(batch: torch.Tensor) -> torch.Tensor:
            if isinstance(batch, torch.Tensor) and batch.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(batch, 0)
            return compiled(batch)

        return forward_any_batch
    if not buckets:
        # Batches of any size and shape (a text model's rows x padded length): one graph
        # with symbolic sizes from the first batch on, not a static one first.
        return torch.compile(forward, dynamic=True)
    # One static graph per bucket (dynamic=False): fixed shapes give the fastest
    # kernels. Dynamo stops recompiling a function after recompile_limit shapes (8 by
    # default) and silently runs it eagerly after that, so make room for every bucket.
    config.recompile_limit = max(config.recompile_limit, len(buckets) + 2)
    return torch.compile(forward, dynamic=False)


def static_input(batch: torch.Tensor) -> torch.Tensor:
    """The copy of a batch that a CUDA graph records its forward with: an inference
    tensor, as every batch the forward has seen. A compiled forward guards on that, so a
    plain copy (made outside inference mode) would compile it again for each bucket,
    past dynamo's recompile limit, after which it runs (and is recorded) eagerly."""
    with torch.inference_mode():
        return batch.clone()


@dataclass(frozen=True, slots=True)
class _Graph:
    """A forward recorded for one input shape: copy the batch in, replay, read the output."""

    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    static_output: Any  # overwritten by every replay: read it before the next one

    def takes(self, batch: torch.Tensor) -> bool:
        static = self.static_input
        return batch.dtype == static.dtype and batch.stride() == static.stride()

    def run(self, batch: torch.Tensor) -> Any:
        self.static_input.copy_(batch)
        self.graph.replay()
        return self.static_output


def _tensors(batch: DeviceInput) -> list[torch.Tensor]:
    return batch if isinstance(batch, list) else [batch]


def _event(cuda: bool) -> torch.cuda.Event | None:
    """A timing event recorded on the current stream (CUDA only)."""
    if not cuda:
        return None
    event = cuda_event(timing=True)
    event.record()
    return event
