"""A model with a fixed cost per batch, as an accelerator-bound model has, for scaling runs.

Serve it with ``conveyor worker --model bench.paced:PacedHandler``. ``forward``
holds the model thread for ``CONVEYOR_PACED_BATCH_MS`` milliseconds per batch
(default 80; the variable is the only way to configure a model class loaded by
path) and returns its input, as ``bench.identity`` does. So a worker serves at
most ``max_batch_size`` requests per batch time whatever the CPU, like a worker
that owns a GPU: adding workers adds capacity even on a small CPU-only machine,
which is what the autoscaling harness (``bench.autoscale``) and the rolling
restart tests need to see.
"""

from __future__ import annotations

import os
import time

import torch

from bench.identity import IdentityHandler

DEFAULT_BATCH_MS = 80.0


class PacedHandler(IdentityHandler):
    """``IdentityHandler`` whose ``forward`` takes a fixed time per batch."""

    name = "paced"
    version = "paced-v1"

    def __init__(self) -> None:
        super().__init__()
        self.batch_s = float(os.environ.get("CONVEYOR_PACED_BATCH_MS", DEFAULT_BATCH_MS)) / 1000

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(self.batch_s)  # the model thread is busy, as with a kernel on a device
        return batch
