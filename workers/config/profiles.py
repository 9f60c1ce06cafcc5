"""Profiles: the tuning ``--profile throughput|latency`` chooses for the settings left unset.

A setting given as a flag, a ``CONVEYOR_*`` variable or a key of the config file
always wins; a profile only fills in what the user did not say. What each sets:

| setting | throughput (default) | latency |
|---|---|---|
| ``max_delay_ms`` | 5 | 2 |
| ``stage_batches`` (batches in the model stage) | 4 on a GPU, 2 on the CPU | 2 |
| ``stage_partial_batches`` | 2 | 1 |
| ``switch_interval_ms`` (longest GIL hold while another thread waits) | 0.5 | 0.2 |

and, for both, on a CUDA device: ``compile`` on (cached per host, so a restart
does not compile again), and ``max_batch_size`` 256 for fixed-size image models
(classification and embeddings; a fixed-size detector, RT-DETR, 64) and text models
(their batches close at ``max_batch_tokens``; other models keep 32); on any device,
``max_batch_size`` 256 for feature-record models (``tabular:``).
docs/operations.md
"Sizing" has the measurements these follow.
"""

from __future__ import annotations

from typing import Any

from workers.config.worker import WorkerSettings

PROFILES: dict[str, dict[str, Any]] = {
    "throughput": {},  # the declared defaults are the throughput ones
    "latency": {
        "max_delay_ms": 2.0,
        "stage_batches": 2,
        "stage_partial_batches": 1,
        # The event loop held the GIL 44% of the time at 600 requests/s a process (py-spy
        # --gil); 0.2 ms lowered the p99 in the worker in two GPU calls of three and
        # changed nothing in the third (docs/bench-log, 2026-11-28).
        "switch_interval_ms": 0.2,
    },
}
"""Per profile: the values it gives settings that were left unset."""

GPU_IMAGE_BATCH = 256
"""``max_batch_size`` of a fixed-size image model on a GPU, unless set."""

GPU_TEXT_BATCH = 256
"""``max_batch_size`` of a text model on a GPU, unless set: its batches close at the token
budget (``max_batch_tokens``, 16,384 rows x padded length), which 32 texts of the median
44 tokens fill to a twelfth (``bench.text``'s mix)."""

FEATURE_ROW_BATCH = 256
"""``max_batch_size`` of a feature-record model on any device, unless set: a row is a few
floats, so a batch's cost is mostly per request, and a batch of 32 paid the per-batch
part eight times as often (the fraud demo's MLP from a backlog, ``--profile latency``, on
a shared 2-core VM: 3,103-3,415 records/s at 32 against 3,990-6,363 at 256, taking
turns; docs/bench-log, 2026-12-02). A lone record still closes its batch at once (the
idle rule)."""


def tuned(
    settings: WorkerSettings,
    *,
    cuda: bool,
    fixed_size_images: bool,
    image_batch: int = GPU_IMAGE_BATCH,
    compiles: bool = True,
    feature_rows: bool = False,
    token_rows: bool = False,
) -> WorkerSettings:
    """``settings`` with the profile's values, and the device's, for every setting left unset.

    ``cuda``: the model runs on a CUDA device; ``fixed_size_images``: its handler takes
    images fitted to one size (a classifier or an embedder), cheap per image, so large
    batches keep the card busy, and one compiled forward a batch size serves them all.
    A model of full-size images (a detector, a segmenter) runs eagerly unless
    ``compile`` is given: its images keep their sizes, so ``torch.compile`` traced a new
    graph for nearly every batch (Faster R-CNN on one H200: 258 s to its first ready
    process, then Dynamo's recompile limit in every process; docs/bench-log,
    2026-11-29). A quantized model (``--quantize``) compiles with ``torch.compile``.
    ``image_batch`` is the ``max_batch_size`` a fixed-size image model takes on a GPU
    (a real-time detector's is smaller: it bounds the process's memory). ``compiles``
    False keeps a fixed-size model eager unless ``compile`` is given (RT-DETR on one
    H200: its package export failed and ``torch.compile`` of four batch sizes had not
    made the first process ready after 150 s cold or 240 s warm; docs/bench-log,
    2026-12-02), and so does a text model given ``compiles`` False (a dual encoder, whose
    batch is a list of images and texts). ``feature_rows``: the handler scores feature
    records (``tabular:``), batched by ``FEATURE_ROW_BATCH`` on any device.
    ``token_rows``: a text model, whose batches the token budget closes; on a GPU
    ``GPU_TEXT_BATCH`` and compiled (with dynamic shapes: its batches vary in rows and
    padded length).
    """
    given = settings.model_fields_set
    update = {k: v for k, v in PROFILES[settings.profile].items() if k not in given}
    if "compile" not in given:
        update["compile"] = cuda and compiles and (fixed_size_images or token_rows)
    if settings.quantize != "none" and "compile_form" not in given:
        # Packages need AOTAutograd's cache, which refuses torchao's weights (no stable
        # hash in torchao 0.18): the package would fail to build at every start.
        update["compile_form"] = "static"
    if cuda and fixed_size_images and "max_batch_size" not in given:
        update["max_batch_size"] = image_batch
    if cuda and token_rows and "max_batch_size" not in given:
        update["max_batch_size"] = GPU_TEXT_BATCH
    if feature_rows and "max_batch_size" not in given:
        update["max_batch_size"] = FEATURE_ROW_BATCH
    return settings.model_copy(update=update)
