"""A demo-model handler with faults on demand, served by fault-test workers.

Loaded by the worker as ``--model tests.faults.faulty:FaultyDigits``:
- an all-white image (pixel value 255, which no real digit has: they stop at
  240) makes ``forward`` raise, wherever it sits in a batch;
- with ``CONVEYOR_TEST_OOM_ABOVE=k``, any batch larger than k raises the
  framework's out-of-memory error, as a GPU would;
- with ``CONVEYOR_TEST_SLOW_MS=t``, every batch takes at least t ms (a slow model);
- a request's ``ce_params`` ``{"pad": n}`` adds an n-character string to its
  answer (a large result);
- with ``CONVEYOR_TEST_FAIL_AT_START=s``, a process whose command line has an
  argument ending in ``s`` (its worker id, ``<host>-cpu-1``, say; ``*``: every
  process) fails its first forward, as a process on a card that cannot run the
  compiled model does, with a RuntimeError saying ``CONVEYOR_TEST_FAIL_AT_START_SAYS``
  (by default a CUDA driver error);
- with ``CONVEYOR_TEST_FAIL_INIT=s``, such a process raises in ``__init__`` (a
  ValueError), as a model that cannot be created there does.
Other warm-up batches (all equal to ``example_item``) never fail.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from demo.models.digits import DigitsClassifier
from schemas import DEFAULT_LIMITS, ContentType, Limits

SPEC = "tests.faults.faulty:FaultyDigits"
"""What a test worker is given as ``--model`` to serve it."""
_DRIVER_ERROR = "injected: CUDA driver error: invalid argument"


def _cued(variable: str) -> bool:
    """Whether this process's command line has an argument ending in ``variable``'s
    value (its worker id does), or the value is ``*``."""
    cue = os.environ.get(variable)
    return bool(cue) and (cue == "*" or any(arg.endswith(str(cue)) for arg in sys.argv))


class FaultyDigits:
    def __init__(self, device: torch.device | str = "cpu", limits: Limits = DEFAULT_LIMITS) -> None:
        self._inner = DigitsClassifier(device=device, limits=limits)
        self.name = "digits"
        self.version = "digits-faulty"
        oom_above = os.environ.get("CONVEYOR_TEST_OOM_ABOVE")
        self._oom_above = int(oom_above) if oom_above else None
        self._slow_s = float(os.environ.get("CONVEYOR_TEST_SLOW_MS", "0")) / 1000.0
        self._fails_at_start = _cued("CONVEYOR_TEST_FAIL_AT_START")
        self._fails_says = os.environ.get("CONVEYOR_TEST_FAIL_AT_START_SAYS", _DRIVER_ERROR)
        if _cued("CONVEYOR_TEST_FAIL_INIT"):
            raise ValueError("injected: this process cannot create the model")

    def example_item(self) -> torch.Tensor:
        return self._inner.example_item()

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return self._inner.preprocess(payload, content_type, {"top_k": params.get("top_k", 5)})

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self._fails_at_start:
            raise RuntimeError(self._fails_says)
        if self._is_warm_up(batch):  # faults are for requests; start-up must succeed
            return self._inner.forward(batch)
        if self._oom_above is not None and batch.shape[0] > self._oom_above:
            raise torch.cuda.OutOfMemoryError(f"injected: batch of {batch.shape[0]}")
        if bool((batch.flatten(1) == 255).all(dim=1).any()):
            raise RuntimeError("injected: a poison item is in this batch")
        if self._slow_s:
            time.sleep(self._slow_s)
        return self._inner.forward(batch)

    def _is_warm_up(self, batch: torch.Tensor) -> bool:
        example = self._inner.example_item().to(batch.device)
        return bool((batch == example).flatten(1).all(dim=1).all())

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        answers = self._inner.postprocess(outputs, [{"top_k": p.get("top_k", 5)} for p in params])
        return [
            {"top": answer, "pad": "x" * int(p["pad"])} if "pad" in p else answer
            for answer, p in zip(answers, params, strict=True)
        ]


def poison_png() -> bytes:
    """The image that makes FaultyDigits fail: a valid 8x8 PNG, all white."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8, 8), 255).save(buf, format="PNG")
    return buf.getvalue()
