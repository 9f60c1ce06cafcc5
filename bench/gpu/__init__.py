"""The GPU benchmark: ceilings, the naive baseline, the model stage and the worker end to end.

    python -m bench.gpu --stages forward,decode,naive,checks,pipeline --out OUT [--compile]
    python -m bench.gpu --stages e2e,kill --kafka-bootstrap HOST:PORT --redis-url URL \
        --e2e-configs 1x1,2x1 --pin --out OUT
    python -m bench.gpu --stages lone --kafka-bootstrap HOST:PORT --redis-url URL --pin \
        --corpora 224x224 --out OUT
    python -m bench.gpu --report --previous OUT1/gpu-bench.json OUT2/gpu-bench.json --out OUT

Stages (each a few minutes at most on an H100 or H200):

- ``forward`` (a): ResNet-50 with random weights, channels-last float16 (and
  ``torch.compile``d with ``--compile``), on uint8 batches already on the GPU,
  normalization included as the worker runs it; CUDA events, median of N.
- ``decode`` (b): decode + fit to 224x224 ceilings for each corpus: Pillow on one
  thread and on a thread per core (with and without ``draft``), nvJPEG batched
  decode alone and with the batched resize (the worker's GPU path), and the GPU's
  hardware JPEG engine through nvImageCodec when it is installed.
- ``naive`` (c): one request at a time, Pillow decode, the same model, synchronous:
  what a tutorial endpoint does per request, minus HTTP.
- ``checks``: float16 vs float32 top-1 agreement on the same inputs and weights,
  and the GPU decode path vs the CPU one (pixel differences after normalization).
- ``pipeline``: the worker's model stage without Kafka (``workers.model.inference``:
  preprocess in a thread pool, then prepare ─▶ launch ─▶ finish on three threads
  and two CUDA streams) for each decode path; img/s and the GPU's idle time
  between forwards (CUDA events): the ceiling of the decode and forward overlapped.
- ``e2e`` (d): the real workers as subprocesses, in each layout of
  ``--e2e-configs`` (worker processes x GPUs). Every worker must be ready and the
  group settled before anything is produced; then each repeat produces a backlog
  from ``--producers`` processes at once, in Kafka transactions committed together
  once all of it is written (the workers read ``read_committed``, so they see the
  whole backlog at once and the producers' rate does not bound theirs), and times
  the steady state (the middle 80% of results by their durable time),
  median/min/max over ``--repeats``, with the GPU's busy share and each worker's
  model stage from its results' timings (busy share, idle gaps between batches,
  ``bench.stats.model_stage``); then p50/p99 latency to durability at about
  half that rate, open loop, from each request's append in Kafka
  (``--latency-from``), with the producers' acknowledgement after due beside it.
  ``--pin`` gives the broker and Redis (``--service-cores``), the producers
  (``--producer-cores``) and the workers cores of their own.
- ``kill``: a worker SIGKILLed a third of the way through a backlog and replaced:
  lost and duplicate-visible counted from Redis and the reply topic. With ``--mps``
  a second worker shares the card, under the run's own MPS server, and goes on.
- ``lone`` (goal 3b): for each model of ``--lone-models`` and each variant (the
  defaults, ``--profile latency``, ``--no-close-idle-batches``), the one command on one
  card, ready and warmed, then ``--lone-requests`` 224x224 JPEGs one at a time through
  the SDK (``submit`` then ``wait``): the round trip's p50 and p99 against ``max_delay``
  + the worker's own batch-1 compute + 5 ms, each part of the hop (the ack, the broker,
  the fetch, the wait, the model, the publish, the read), then a backlog's img/s on the
  same host.
- ``detect``: detectors (``--detectors``, random weights) on the 640x480 corpus,
  naive against the worker's model stage (``bench.detect``).
- ``text``: ``bench.text``'s models (``--text-models``) through ``conveyor worker --model
  hf:FOLDER`` with its defaults, a backlog of its mix of texts and half of it paced,
  against their forward over the worker's token batches, compiled on a GPU
  (``bench.gpu.text``).

Every run writes ``gpu-bench.json`` (merged with ``--previous`` files) and
``gpu-bench.png`` into ``--out`` and prints the summary table last. Nothing is
downloaded: the model has random weights (its outputs mean nothing; its cost is
the real one), the JPEG corpus is synthesised in memory and the texts are made by a
rule from Python's docstrings.

Where each stage lives: ``ceilings`` (forward, overlap, decode, naive, checks),
``model_stage`` (pipeline), ``e2e``, ``lone``, ``text``, ``host`` (the one command a host runs, and
the ready and kill stages), ``load`` (the producer processes), ``cores``
(``--pin``), ``corpus``, ``config`` (the run's settings, timers and model),
``report`` (summary, table, plot) and ``cli``; ``bench.detect`` holds detect's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.gpu.cli import main, parse_args
    from bench.gpu.corpus import Corpus, build_corpora, make_corpus, synthetic_jpeg
    from bench.gpu.host import expected_processes, parse_layout
    from bench.gpu.load import paced_processes
    from bench.gpu.report import summarize

# Imported when first asked for: a producer process (``python -m bench.gpu.load``) runs
# inside this package and must not import torch and every stage to send its records.
_HOMES = {
    "Corpus": "corpus",
    "build_corpora": "corpus",
    "expected_processes": "host",
    "main": "cli",
    "make_corpus": "corpus",
    "paced_processes": "load",
    "parse_args": "cli",
    "parse_layout": "host",
    "summarize": "report",
    "synthetic_jpeg": "corpus",
}

__all__ = [
    "Corpus",
    "build_corpora",
    "expected_processes",
    "main",
    "make_corpus",
    "paced_processes",
    "parse_args",
    "parse_layout",
    "summarize",
    "synthetic_jpeg",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
