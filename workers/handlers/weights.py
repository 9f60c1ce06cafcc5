"""Weights and labels files: read with errors that name the file and what to change.

Shared by every spec form that loads files (``workers.model.loader``,
``workers.handlers.torchvision_models`` and ``workers.handlers.timm_models``). Nothing
here downloads anything (``workers.handlers.published`` does, when asked).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

RANDOM_WEIGHTS = "random"
"""``weights="random"``: a benchmark model whose outputs mean nothing."""


class ModelLoadError(ValueError):
    """A model spec, weights file or handler class that cannot be served; the message
    names the spec and what to change. Retrying does not help."""


def require_file(spec: str, path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{spec}: {path} does not exist or is not a file")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_labels(path: Path) -> list[str] | None:
    """Labels from ``PATH.labels.json`` (a JSON list of strings), if that file exists."""
    sidecar = path.with_name(f"{path.name}.labels.json")
    if not sidecar.is_file():
        return None
    try:
        labels = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{sidecar}: cannot read labels: {exc}") from exc
    if not (isinstance(labels, list) and labels and all(isinstance(s, str) for s in labels)):
        raise ModelLoadError(f"{sidecar}: must hold a non-empty JSON list of label strings")
    return labels


def read_state_dict(spec: str, file: Path) -> dict[str, Any]:
    """The tensors of a ``state_dict`` file (or of a training checkpoint around one), or
    of a ``.safetensors`` file (the Hugging Face Hub's form)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file  # installed with timm (the timm extra)

            return load_file(file, device="cpu")
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"{spec}: cannot load weights from {file}: {exc}. It must be the model's "
            "state_dict saved with torch.save (plain tensors, loadable with weights_only=True) "
            "or with safetensors"
        ) from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a training checkpoint around the weights
    if not isinstance(state, dict):
        raise ModelLoadError(f"{spec}: {file} holds a {type(state).__name__}, not a state_dict")
    return state


def load_state_dict(spec: str, module: torch.nn.Module, file: Path, state: Any = None) -> None:
    """Load ``file`` (or its already read ``state``) into ``module``, every key matching."""
    if state is None:
        state = read_state_dict(spec, file)
    try:
        module.load_state_dict(state)
    except Exception as exc:
        raise ModelLoadError(
            f"{spec}: cannot load weights from {file}: {exc}. It must be the model's "
            "state_dict saved with torch.save (plain tensors, loadable with weights_only=True); "
            "a model trained on other classes names them in PATH.labels.json"
        ) from exc
