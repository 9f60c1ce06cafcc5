"""What an ``hf:`` folder and the installed transformers say before any model loads.

Read without importing transformers: an ``hf:`` folder of another task goes to its own
loader, and a transformers too old for the engine is refused with the version to
install instead of an error from inside its continuous batching.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

MIN_TRANSFORMERS = (5, 18)
"""The first transformers whose ``ContinuousBatchingConfig`` takes the paged cache's
``page_size`` (5.17 named it ``block_size``) and per-request logits processors, which
the engine passes (``workers.generation.engine``)."""

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def causal_lm_architecture(path: str) -> str | None:
    """The ``*ForCausalLM`` architecture the folder's config names, else None (so an
    ``hf:`` folder of another task goes to its own loader)."""
    names = _config(path).get("architectures") or []
    return next((n for n in names if isinstance(n, str) and n.endswith("ForCausalLM")), None)


def auto_dtype(path: str, device: torch.device) -> torch.dtype:
    """``--dtype auto`` for a causal LM: on a GPU the half precision its config was saved
    in (``dtype``, or ``torch_dtype`` before transformers 5), as the model was trained
    and published; float32 on the CPU or when the config names none."""
    config = _config(path)
    named = config.get("dtype") or config.get("torch_dtype")
    if device.type != "cuda" or not isinstance(named, str):
        return torch.float32
    return _HALF.get(named, torch.float32)


def transformers_problem(installed: str | None = None) -> str | None:
    """Why the installed transformers cannot run the engine, or None when it can.
    ``installed`` stands for the installed version (tests)."""
    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:
            return "text generation needs transformers: pip install 'conveyor[hf]'"
    parts = tuple(int(p) for p in re.findall(r"\d+", installed)[:2])
    if parts >= MIN_TRANSFORMERS:
        return None
    least = ".".join(map(str, MIN_TRANSFORMERS))
    return (
        f"text generation needs transformers >= {least} (its continuous batching's paged "
        f"cache options); {installed} is installed: pip install -U 'transformers>={least}'"
    )


def _config(path: str) -> dict[str, Any]:
    try:
        found = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
