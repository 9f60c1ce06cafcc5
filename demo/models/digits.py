"""The demo model: a small CNN for scikit-learn's bundled 8x8 digits, trained in seconds.

Nothing can be downloaded where Conveyor's tests and demo run, so the project
trains its own model on data that ships inside scikit-learn (1797 grayscale
8x8 digits with values 0..16). The split and every seed are fixed, so each
build gives the same held-out set; ``heldout_digits`` returns that set as PNG
files, the payloads the demo and the tests submit.

Digit values map to 8-bit pixels as ``value * 15`` (0..240), exactly invertible,
and training feeds those uint8 pixels through the serving handler's own
``forward``, so a submitted PNG reaches the network as the very tensor it was
trained on.

The worker serves it as it serves any handler class of a user's:
``--model demo.models.digits:DigitsClassifier``, or ``--model digits`` for short
(``workers.model.loader``). Build it with ``python -m demo.models.digits [--force]``;
the worker also builds it on first use, in ``$CONVEYOR_MODEL_DIR`` or the user's
cache folder (see ``default_model_path``). Training needs scikit-learn (the
``demo`` extra); serving a built artifact needs only the worker extra. A
container image builds it at image build time, so that a worker running as an
unprivileged user only reads it.
"""

from __future__ import annotations

import argparse
import errno
import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from common.install import DISTRIBUTION, install_hint
from schemas import DEFAULT_LIMITS, Limits
from workers.handlers import (
    MODEL_DIR_VARIABLE,
    RANDOM_WEIGHTS,
    DecodeBudget,
    ImageClassifier,
    ImageSpec,
)

DIGITS_VERSION = "digits-cnn-v1"
"""Reported as ``model_version``; bump it when the architecture or training changes."""
MIN_HELDOUT_ACCURACY = 0.95
"""A build that scores less on the held-out set fails instead of serving a bad model."""

PIXEL_STEP = 15
"""uint8 pixel = digit value (0..16) * 15: the largest exact step that fits in 8 bits."""
DIGITS_IMAGE = ImageSpec(height=8, width=8, mode="L")
# Normalized input = pixel / 240 = the original value / 16, in [0, 1].
_MEAN = (0.0,)
_STD = (16 * PIXEL_STEP / 255.0,)

_FORMAT = "conveyor.digits-cnn/1"
_LABELS = [str(d) for d in range(10)]
_SEED = 1797
_HELDOUT_SHARE = 0.2
_EPOCHS = 10
_BATCH = 32
_LEARNING_RATE = 3e-3


class ModelCacheError(OSError):
    """The artifact's folder cannot be written (or found): the message says what to set."""


def default_model_path() -> Path:
    """``$CONVEYOR_MODEL_DIR/digits-cnn-v1.pt``, else in the user's cache folder."""
    return model_folder() / f"{DIGITS_VERSION}.pt"


def model_folder() -> Path:
    """Where the demo models are built: ``$CONVEYOR_MODEL_DIR``, else the user's cache folder.

    The cache folder is ``$XDG_CACHE_HOME/conveyor-serve/models``, else
    ``~/.cache/conveyor-serve/models``. Never beside the installed package: that
    folder usually belongs to root, and a worker should not run as root.
    """
    model_dir = os.environ.get(MODEL_DIR_VARIABLE)
    if model_dir:
        return Path(model_dir)
    cache = os.environ.get("XDG_CACHE_HOME")
    if not cache:
        try:
            cache = str(Path.home() / ".cache")
        except RuntimeError:  # no HOME and no passwd entry, as for an arbitrary container uid
            raise ModelCacheError(
                f"no folder for the demo model: this user has no home folder; set "
                f"{MODEL_DIR_VARIABLE} to a folder it may write"
            ) from None
    return Path(cache) / DISTRIBUTION / "models"


def build_digits_model(path: Path | None = None, *, force: bool = False) -> Path:
    """Train the model and save it at ``path`` unless a current artifact is already there.

    The artifact is a plain dict of tensors, labels and metadata (``heldout_accuracy``,
    ``train_seconds``, ...) that loads with ``torch.load(weights_only=True)``. It is
    written to a temporary file and renamed, so concurrent builders never see half a file.
    Raises ``RuntimeError`` if the held-out accuracy is below ``MIN_HELDOUT_ACCURACY``.
    """
    path = path or default_model_path()
    if not force and _is_current(path):
        return path
    _check_writable(path.parent)  # before seconds of training, not after
    started = time.monotonic()
    state, accuracy = _train()
    artifact = {
        "format": _FORMAT,
        "version": DIGITS_VERSION,
        "state_dict": state,
        "labels": _LABELS,
        "heldout_accuracy": accuracy,
        "heldout_size": len(_split()[1]),
        "seed": _SEED,
        "train_seconds": time.monotonic() - started,
        "torch_version": str(torch.__version__),
    }
    if accuracy < MIN_HELDOUT_ACCURACY:
        raise RuntimeError(
            f"{DIGITS_VERSION} scored {accuracy:.3f} on its held-out digits, below "
            f"{MIN_HELDOUT_ACCURACY}; the training recipe in {__name__} is broken"
        )
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(artifact, partial)
        partial.replace(path)
    except OSError as exc:
        raise _cache_error(path.parent, exc) from exc
    return path


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(folder, exc) from exc
    if not os.access(folder, os.W_OK):
        raise _cache_error(folder, PermissionError(errno.EACCES, "permission denied"))


def _cache_error(folder: Path, exc: OSError) -> ModelCacheError:
    error = ModelCacheError(
        f"cannot write the demo model to {folder} ({exc.strerror or exc}): set "
        f"{MODEL_DIR_VARIABLE} to a folder this user may write, or build the model ahead "
        "of time (python -m demo.models.digits) as a user who may write there"
    )
    error.errno = exc.errno
    return error


def digits_metadata(path: Path | None = None) -> dict[str, Any]:
    """The artifact's metadata (everything but the weights), building it if needed."""
    artifact = _load(build_digits_model(path))
    return {key: value for key, value in artifact.items() if key != "state_dict"}


class DigitsClassifier(ImageClassifier):
    """The demo model as a handler (named ``digits``), building the artifact if it is missing.

    ``weights`` is the artifact's path (default ``default_model_path()``). The other
    arguments are the worker's settings, which the loader passes by name.
    """

    def __init__(
        self,
        weights: str | Path | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        limits: Limits = DEFAULT_LIMITS,
        decode_budget: DecodeBudget | None = None,
    ) -> None:
        if weights == RANDOM_WEIGHTS:
            raise ValueError(
                "the demo model trains its own weights in seconds; leave weights unset "
                "or pass the path of its artifact"
            )
        artifact = _load(build_digits_model(Path(weights) if weights else None))
        # Built on the meta device, then given the saved tensors: no wasted random init.
        with torch.device("meta"):
            module = _digits_cnn()
        module.load_state_dict(artifact["state_dict"], assign=True)
        super().__init__(
            module,
            name="digits",
            version=DIGITS_VERSION,
            labels=artifact["labels"],
            image=DIGITS_IMAGE,
            mean=_MEAN,
            std=_STD,
            device=device,
            dtype=dtype,
            channels_last=channels_last,
            limits=limits,
            decode_budget=decode_budget,
        )


def digit_png(pixels_8x8: npt.ArrayLike) -> bytes:
    """An 8x8 digit with values 0..16 (as in ``load_digits``) as grayscale PNG bytes."""
    values = np.asarray(pixels_8x8)
    if values.shape != (8, 8):
        raise ValueError(f"a digit is 8x8 values, got shape {values.shape}")
    if not (np.all(values == np.round(values)) and values.min() >= 0 and values.max() <= 16):
        raise ValueError("digit values must be whole numbers from 0 to 16")
    buffer = io.BytesIO()
    Image.fromarray((values * PIXEL_STEP).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def heldout_digits() -> list[tuple[bytes, int]]:
    """Every held-out digit (never trained on) as PNG bytes with its true value."""
    images, target = _digits()
    _, heldout = _split()
    return [(digit_png(images[i]), int(target[i])) for i in heldout]


def digit_pixels(indices: npt.NDArray[np.intp] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as the uint8 (N, 1, 8, 8) pixel tensor the model trains on, and their values.

    ``indices`` picks rows of ``load_digits()`` (default: all of them).
    """
    images, target = _digits()
    if indices is not None:
        images, target = images[indices], target[indices]
    pixels = torch.from_numpy((images * PIXEL_STEP).astype(np.uint8)).unsqueeze(1)
    return pixels, torch.from_numpy(target.astype(np.int64))


def heldout_indices() -> npt.NDArray[np.intp]:
    """Rows of ``load_digits()`` held out from training, in ``heldout_digits`` order."""
    return _split()[1]


def _digits() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    try:
        # Lazily: it costs seconds at worker start-up, and serving a built model needs none.
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            f"the demo models train on scikit-learn's digits: {install_hint('demo')} ({exc})"
        ) from None

    data = load_digits()
    return data.images, data.target


def _split() -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Stratified 80/20 split of row indices, the same on every call and machine."""
    _, target = _digits()
    from sklearn.model_selection import train_test_split

    train, heldout = train_test_split(
        np.arange(len(target)), test_size=_HELDOUT_SHARE, stratify=target, random_state=_SEED
    )
    return train, heldout


def _digits_cnn() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),  # 8x8 -> 4x4
        torch.nn.Conv2d(16, 32, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, len(_LABELS)),
    )


def _train() -> tuple[dict[str, torch.Tensor], float]:
    """Train on the fixed split; returns the weights and the held-out accuracy."""
    train_idx, heldout_idx = _split()
    train_x, train_y = digit_pixels(train_idx)
    heldout_x, heldout_y = digit_pixels(heldout_idx)
    threads = torch.get_num_threads()
    # fork_rng keeps the seeding to this block: the caller's random state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        # A model this small trains fastest on few threads; more only add overhead.
        torch.set_num_threads(min(threads, 2))
        try:
            # Training goes through the serving handler's forward, so the pixels are
            # normalized by the same code, in the same float steps, as when serving.
            handler = ImageClassifier(
                _digits_cnn(),
                name="digits",
                version=DIGITS_VERSION,
                labels=_LABELS,
                image=DIGITS_IMAGE,
                mean=_MEAN,
                std=_STD,
            )
            module = handler.module.train()
            optimizer = torch.optim.Adam(module.parameters(), lr=_LEARNING_RATE)
            for _ in range(_EPOCHS):
                for batch in torch.split(torch.randperm(len(train_y)), _BATCH):
                    optimizer.zero_grad()
                    loss = torch.nn.functional.cross_entropy(
                        handler.forward(train_x[batch]), train_y[batch]
                    )
                    torch.autograd.backward(loss)
                    optimizer.step()
            module.eval()
            with torch.inference_mode():
                predicted = handler.forward(heldout_x).argmax(dim=1)
        finally:
            torch.set_num_threads(threads)
    accuracy = float((predicted == heldout_y).double().mean())
    return {key: value.detach().clone() for key, value in module.state_dict().items()}, accuracy


def _load(path: Path) -> dict[str, Any]:
    artifact: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return artifact


def _is_current(path: Path) -> bool:
    """Whether ``path`` holds a readable artifact of this version (else it is rebuilt)."""
    if not path.is_file():
        return False
    try:
        artifact = _load(path)
    except Exception:
        # Truncated, corrupt or from an incompatible torch: any unreadable file is rebuilt.
        return False
    return bool(artifact.get("format") == _FORMAT and artifact.get("version") == DIGITS_VERSION)


def main(argv: list[str] | None = None) -> None:
    """``python -m demo.models.digits [--force] [--path PATH]``: build and report."""
    parser = argparse.ArgumentParser(prog="python -m demo.models.digits", description=__doc__)
    parser.add_argument("--force", action="store_true", help="retrain even if it is cached")
    parser.add_argument("--path", type=Path, default=None, help="artifact path")
    args = parser.parse_args(argv)
    path = build_digits_model(args.path, force=args.force)
    meta = digits_metadata(path)
    print(
        f"{meta['version']}: held-out accuracy {meta['heldout_accuracy']:.2%} "
        f"on {meta['heldout_size']} digits, trained in {meta['train_seconds']:.1f} s -> {path}"
    )


if __name__ == "__main__":
    main()
